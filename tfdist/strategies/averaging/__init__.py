"""Model averaging (local SGD, SlowMo, Streaming DiLoCo) as objects: the strategy
(`model_average`), its state (`fragment`), runner (`runner`) and stages (`exchange`), the
outer optimizer (`outer`), its Keras hand-off (`keras`) and elastic jobs (`elastic`)."""
