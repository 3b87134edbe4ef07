"""`tfdist train`'s report.png and `tfdist compare`'s plot and table: words, plurals,
integer epochs, distinguishable identical curves; and atomic writes."""

import os

import pytest

from tfdist.train.compare import coinciding, plot_compare
from tfdist.train.outdir import write_atomic
from tfdist.train.report import describe_topology, plot_history


def _report(**extra):
    report = {"name": "mirrored", "strategy": "MirroredStrategy", "num_replicas": 2,
              "workers": 1, "ps": 0, "history": {"loss": [1.0, 0.5, 0.2],
                                                 "accuracy": [0.5, 0.7, 0.9],
                                                 "val_loss": [1.1, 0.6, 0.3],
                                                 "val_accuracy": [0.4, 0.6, 0.8]}}
    report.update(extra)
    return report


@pytest.mark.unit
@pytest.mark.parametrize("extra,text", [
    ({}, "2 replicas"),
    ({"num_replicas": 1}, "1 replica"),
    ({"num_replicas": 4, "workers": 2}, "4 replicas on 2 workers"),
    ({"num_replicas": 2, "workers": 2}, "2 replicas"),
    ({"num_replicas": 1, "workers": 2, "ps": 1}, "2 workers, 1 parameter server"),
    ({"num_replicas": 1, "workers": 1, "ps": 2}, "1 worker, 2 parameter servers"),
])
def test_topology_words(extra, text):
    assert describe_topology(_report(**extra)) == text


@pytest.mark.unit
def test_report_png_has_name_strategy_and_integer_epochs(tmp_path, monkeypatch):
    import matplotlib.figure

    seen = {}
    save = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kwargs):
        seen["title"] = fig._suptitle.get_text()
        seen["ticks"] = [t for ax in fig.axes for t in ax.get_xticks()
                         if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        return save(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    plot_history(_report(num_replicas=1, workers=2, ps=1,
                         strategy="ParameterServerStrategy",
                         name="parameter_server"), tmp_path / "r.png")
    assert seen["title"] == "parameter_server: ParameterServerStrategy, 2 workers, " \
                            "1 parameter server"
    assert seen["ticks"] and all(float(t).is_integer() for t in seen["ticks"])
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.unit
def test_identical_curves_are_found_and_noted(tmp_path, monkeypatch):
    curves = {"a": [0.5, 0.9], "b": [0.5, 0.9], "c": [0.5, 0.8], "d": [0.5, 0.8 + 1e-9]}
    assert coinciding(curves) == [["a", "b"], ["c", "d"]]
    import matplotlib.figure

    seen = {}
    save = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kwargs):
        seen["note"] = fig.axes[0].get_xlabel()
        seen["ylabel"] = fig.axes[0].get_ylabel()
        seen["xlabel"] = fig.axes[1].get_xlabel()
        seen["markers"] = [line.get_marker() for line in fig.axes[0].get_lines()]
        return save(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    summary = [{"name": n, "history": {"val_accuracy": c}, "final": {"val_accuracy": c[-1]},
                "bytes_communicated": 10 ** i, "wall_time_seconds": 1.0}
               for i, (n, c) in enumerate(curves.items())]
    plot_compare(summary, tmp_path / "c.png")
    assert seen["note"] == "epoch\na = b: identical curves\nc = d: identical curves"
    assert seen["ylabel"] == "val_accuracy"
    assert seen["xlabel"] == "bytes communicated (log)"
    assert len(set(seen["markers"])) == 4


@pytest.mark.unit
def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path):
    target = tmp_path / "report.json"
    write_atomic(target, lambda tmp: tmp.write_text("old"))

    def half_write(tmp):
        tmp.write_text("partial")
        raise KeyboardInterrupt("killed mid-write")

    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, half_write)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["report.json"]  # no temporary file left


@pytest.mark.unit
def test_write_atomic_keeps_the_suffix_for_keras_and_matplotlib(tmp_path):
    seen = []
    write_atomic(tmp_path / "model.keras",
                 lambda tmp: (seen.append(tmp), tmp.write_bytes(b"x")))
    assert seen[0].suffix == ".keras" and seen[0].parent == tmp_path
    assert (tmp_path / "model.keras").read_bytes() == b"x"
