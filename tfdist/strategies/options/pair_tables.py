"""The decided pairs of `tfdist.strategies.options.pairs`, per registry entry: data.

`PAIRS` (per strategy: ``{pair: Composes | Refused}``), `ALONE` (options refused with
every other option and mode), `SETTINGS` and `ALIASES` (the rules of many pairs at once,
said in `tfdist.strategies.options.pairs`' docstring).
"""

from __future__ import annotations

from tfdist.strategies.options.pair_types import (ELASTIC, MAX_RESTARTS, MULTI_NODE, RAY, SPARK,
                                          Composes, Refused)

T = "tests/"
_LAUNCHED_SYNC = T + "test_multi_worker.py::test_fit_matches_single_process_and_shards_exactly_once"
_RESTART = T + "test_multi_worker.py::test_resume_after_killed_worker_matches_uninterrupted"
_NODES = T + "test_multi_node.py::test_two_node_multi_worker_job_matches_the_single_process_reference"
_SPARK = T + "test_spark.py::test_multi_worker_mirrored_equals_reference_twice_in_one_session"
_RAY = T + "test_ray.py::test_multi_worker_mirrored_equals_reference_twice"
_PAIRS_TEST = T + "test_pair_references.py::"
_FSDP_TEST = T + "test_fsdp.py::test_sharded_parameters_match_one_device_and_save_unsharded"

# option -> the test of the setting itself (see the module's rules).
SETTINGS = {
    "collective_timeout": T + "test_multi_worker.py::test_frozen_peer_fails_after_collective_timeout",
    "heartbeat_timeout": T + "test_multi_worker.py::test_killed_peer_makes_survivor_exit",
    "startup_timeout": T + "test_multi_worker.py::test_missing_peer_is_named_after_startup_timeout",
    "engine": T + "test_zero.py::test_two_workers_horovod_engine",
    "devices": T + "test_mirrored.py::test_mirrored_matches_single_device",
    # shard_parameters' settings: without shard_parameters=True they change nothing
    "min_shard_elements": _FSDP_TEST,
    "shard_filter": T + "test_fsdp.py::test_shard_filter_decides_before_the_size_rule",
    "reshard_after_forward": _FSDP_TEST,
    "commit_every_steps": T + "test_elastic.py::test_commits_every_k_calls_of_several_steps_roll_back_at_most_k_calls",
    # parameter servers: what the coordinator does, not what a step computes
    "chief_poll_seconds": T + "test_parameter_server.py::test_worker_killed_mid_fit_still_completes",
    "exactly_once": T + "test_parameter_server.py::test_killed_and_crashed_workers_restart_alone_and_every_step_applies_once",
    "mode": T + "test_parameter_server.py::test_sync_equals_single_device_on_summed_batch",
    "step_timeout": T + "test_parameter_server.py::test_watchdog_asks_the_launcher_to_restart_a_hung_worker",
    "steps_per_dispatch": T + "test_parameter_server.py::test_async_fit_three_inputs_evaluate_predict",
    "update_block_bytes": T + "test_ps_save.py::test_sharded_model_saves_resumes_after_a_ps_kill_loads_plain_and_reshards",
    # model averaging: how often it averages, the base every one of its tests sets
    "period": T + "test_model_average.py::test_local_sgd_matches_numpy",
}
# option -> the options it holds (its pairs are theirs).
ALIASES = {"communication_options": ("compression", "accumulate_steps", "collective_timeout")}
ALIAS_TEST = T + "test_communication.py::test_options_validation"


def _sync_pairs(launched: bool) -> dict:
    """The pairs of the synchronous features (accumulate_steps, compression,
    shard_optimizer_state), and with ``launched`` their pairs with launch modes."""
    pairs = {
        frozenset({"accumulate_steps", "compression"}): Composes(
            (T + "test_communication.py::test_multi_worker_accumulate_and_compression",)),
        frozenset({"accumulate_steps", "shard_optimizer_state"}): Composes(
            (T + "test_zero.py::test_sharded_matches_unsharded_with[accumulate]",)),
        frozenset({"compression", "shard_optimizer_state"}): Composes(
            (_PAIRS_TEST + "test_sharded_state_with_compression_equals_unsharded",)),
        frozenset({"shard_optimizer_state", "shard_parameters"}): Refused(
            "shard_parameters=True shards the optimizer state with the parameters; drop "
            "shard_optimizer_state", {"shard_parameters": True, "shard_optimizer_state": True}),
        frozenset({"accumulate_steps", "shard_parameters"}): Composes(
            (T + "test_fsdp.py::test_accumulate_steps_equals_the_unsharded_accumulation",),
            note="clipping by norm is refused at the first step (not built yet)"),
        frozenset({"compression", "shard_parameters"}): Composes(
            (T + "test_fsdp.py::test_sharded_parameters_with_compression",)),
    }
    if not launched:
        return pairs
    # from tests/test_elastic_state.py (each parametrized: shard, accumulate, both)
    state = T + "test_elastic_state.py::test_{}_keeps_the_state_of_every_feature"
    elastic = tuple(state.format(event) for event in ("a_lost_worker", "an_added_worker",
                                                      "a_lost_rank_0"))
    launched_tests = {
        "accumulate_steps": T + "test_communication.py::test_multi_worker_accumulate_and_compression",
        "compression": T + "test_communication.py::test_multi_worker_accumulate_and_compression",
        "shard_optimizer_state": T + "test_zero.py::test_two_workers_tf_engine",
    }
    resumed = {
        "accumulate_steps": _PAIRS_TEST + "test_accumulated_training_resumes_from_a_save",
        "compression": _PAIRS_TEST + "test_compressed_training_resumes_from_a_save",
        "shard_optimizer_state": T + "test_zero.py::test_backup_and_restore_resumes_sharded_state",
    }
    for option, launched_test in launched_tests.items():
        pairs[(option, MULTI_NODE)] = Composes((launched_test, _NODES))
        pairs[(option, SPARK)] = Composes((launched_test, _SPARK))
        pairs[(option, RAY)] = Composes((launched_test, _RAY))
        pairs[(option, MAX_RESTARTS)] = Composes((resumed[option], _RESTART))
    pairs[("accumulate_steps", ELASTIC)] = Composes(elastic)
    pairs[("shard_optimizer_state", ELASTIC)] = Composes(elastic)
    pairs[("shard_parameters", ELASTIC)] = Refused(
        "shard_parameters=True cannot re-shard the parameters for a new membership yet",
        {"shard_parameters": True})
    fsdp = T + "test_fsdp.py::test_two_workers"
    pairs[("shard_parameters", MULTI_NODE)] = Composes((fsdp, _NODES))
    pairs[("shard_parameters", SPARK)] = Composes((fsdp, _SPARK))
    pairs[("shard_parameters", RAY)] = Composes((fsdp, _RAY))
    pairs[("shard_parameters", MAX_RESTARTS)] = Composes(
        (T + "test_fsdp.py::test_sharded_training_resumes_from_a_save", _RESTART))
    pairs[("compression", ELASTIC)] = Composes(
        (_PAIRS_TEST + "test_a_lost_worker_in_a_compressed_elastic_job",),
        note="a cast on the wire: no state of its own (no residuals) to hand over")
    pairs[("engine", ELASTIC)] = Refused(
        "it needs engine='horovod': engine={value!r} cannot re-form its cluster inside a "
        "running process (TF's collectives and coordination service are fixed at start)",
        {"engine": "tf"}, allowed=("horovod", "auto"))
    return pairs


def _average_pairs() -> dict:
    """Model averaging's pairs (its own options and the launch modes)."""
    delay = T + "test_model_average_delay.py::test_delay_and_mix_match_numpy_streaming_diloco"
    quant = T + "test_model_average_quant.py::"
    smoke = _PAIRS_TEST + "test_model_average_pair_trains_and_agrees[{}-{}]"
    pairs = {
        frozenset({"fragments", "average_optimizer_state"}): Refused(
            "average_optimizer_state needs fragments=1",
            {"fragments": 2, "average_optimizer_state": True, "period": 2}),
        frozenset({"sync_delay", "warmup_steps"}): Refused(
            "warmup_steps needs sync_delay=0 and mix=1", {"sync_delay": 1, "warmup_steps": 2, "period": 4}),
        frozenset({"mix", "warmup_steps"}): Refused(
            "warmup_steps needs sync_delay=0 and mix=1", {"mix": 0.5, "warmup_steps": 2, "period": 4}),
        frozenset({"sync_delay", "average_optimizer_state"}): Refused(
            "average_optimizer_state needs sync_delay=0 and mix=1",
            {"sync_delay": 1, "average_optimizer_state": True, "period": 4}),
        frozenset({"mix", "average_optimizer_state"}): Refused(
            "average_optimizer_state needs sync_delay=0 and mix=1",
            {"mix": 0.5, "average_optimizer_state": True, "period": 4}),
        frozenset({"outer_compression", "compression"}): Refused(
            "outer_compression and compression", {"outer_compression": "int8",
                                                   "compression": "fp16", "period": 2}),
        frozenset({"fragments", "outer_optimizer"}): Composes(
            (T + "test_model_average_fragments.py::test_fragments_match_numpy_streaming_diloco[True]",)),
        frozenset({"fragments", "sync_delay"}): Composes((delay + "[4-2-1-1.0-False]",)),
        frozenset({"fragments", "mix"}): Composes((delay + "[4-2-0-0.5-False]",)),
        frozenset({"sync_delay", "mix"}): Composes((delay + "[4-2-1-0.5-True]",)),
        frozenset({"sync_delay", "outer_optimizer"}): Composes((delay + "[4-1-2-1.0-True]",)),
        frozenset({"mix", "outer_optimizer"}): Composes((delay + "[4-2-1-0.5-True]",)),
        frozenset({"fragments", "outer_compression"}): Composes(
            (quant + "test_quantized_diloco_matches_numpy[int4-2-True]",)),
        frozenset({"outer_optimizer", "outer_compression"}): Composes(
            (quant + "test_quantized_diloco_matches_numpy[int4-2-True]",)),
        frozenset({"sync_delay", "outer_compression"}): Composes(
            (quant + "test_quantized_overlapped_syncs_match_numpy[int4-1-0.5]",)),
        frozenset({"mix", "outer_compression"}): Composes(
            (quant + "test_quantized_overlapped_syncs_match_numpy[int4-1-0.5]",)),
    }
    for a, b in (("warmup_steps", "outer_optimizer"), ("warmup_steps", "average_optimizer_state"),
                 ("warmup_steps", "fragments"), ("warmup_steps", "outer_compression"),
                 ("warmup_steps", "compression"), ("outer_optimizer", "average_optimizer_state"),
                 ("outer_optimizer", "compression"), ("average_optimizer_state", "outer_compression"),
                 ("average_optimizer_state", "compression"), ("fragments", "compression"),
                 ("sync_delay", "compression"), ("mix", "compression")):
        pairs[frozenset({a, b})] = Composes((smoke.format(a, b),))
    # Launch modes. Elastic: only what model averaging hands to a joiner today.
    cannot = ("ModelAverageStrategy averages whole models at each average and commits every "
              "step: {what} cannot be handed to a joiner yet (docs/elastic.md, Limits)")
    for option, what in (("fragments", "Streaming DiLoCo (fragments, sync_delay, mix)"),
                         ("sync_delay", "Streaming DiLoCo (fragments, sync_delay, mix)"),
                         ("mix", "Streaming DiLoCo (fragments, sync_delay, mix)"),
                         ("outer_compression", "outer_compression's residuals")):
        pairs[(option, ELASTIC)] = Refused(cannot.format(what=what),
                                           {option: _EXAMPLE[option], "period": 4})
    # Handed over by design (docs/elastic.md), but no test checks a loss or a joiner
    # with them against a reference: refused until one does.
    for option in ("outer_optimizer", "warmup_steps", "average_optimizer_state",
                   "compression"):
        pairs[(option, ELASTIC)] = Refused(
            "ModelAverageStrategy takes only period and the timeouts: no test yet checks "
            "a lost or added member against a reference with " + option,
            {option: _EXAMPLE[option], "period": 4})
    pairs[("commit_every_steps", ELASTIC)] = Refused(
        "ModelAverageStrategy commits every step: a commit between averages could not be "
        "shared", {"commit_every_steps": 2}, allowed=(1,))
    pairs[("engine", ELASTIC)] = _sync_pairs(True)[("engine", ELASTIC)]
    pairs[("period", ELASTIC)] = Composes(
        (T + "test_elastic_average.py::test_a_worker_lost_is_dropped_from_the_next_average",
         T + "test_elastic_average.py::test_a_joiner_starts_from_the_last_average"))
    for mode in (ELASTIC, MULTI_NODE, SPARK, RAY, MAX_RESTARTS):
        pairs[("devices", mode)] = Refused(
            "devices is for one host; with several workers every local device is a replica",
            {"devices": ["/cpu:0"]})
    launched = {
        "period": T + "test_model_average.py::test_two_workers_period_4_matches_numpy",
        "fragments": T + "test_model_average_fragments.py::test_two_workers_fragments_match_numpy",
        "sync_delay": T + "test_model_average_delay.py::test_two_workers_delay_and_mix_match_numpy",
        "mix": T + "test_model_average_delay.py::test_two_workers_delay_and_mix_match_numpy",
        "outer_compression": quant + "test_two_workers_quantized_match_numpy",
        "outer_optimizer": T + "test_model_average_fragments.py::test_two_workers_fragments_match_numpy",
    }
    # In-process tests of the option (2 replicas of one host), and a launched job of
    # model averaging: the option adds nothing a launch mode sees.
    two = T + "test_model_average.py::test_two_workers_period_4_matches_numpy"
    for option, test in (
            ("warmup_steps", T + "test_model_average.py::test_local_sgd_matches_numpy[3-2-3]"),
            ("average_optimizer_state", T + "test_model_average.py::test_average_optimizer_state"),
            ("compression", T + "test_model_average.py::test_compressed_average_is_close_and_consistent")):
        launched[option] = (test, two)
    resumed = {
        "period": T + "test_model_average.py::test_save_restore_mid_period_resumes_exactly",
        "fragments": quant + "test_backup_resumes_exactly_with_int4_fragments",
        "outer_compression": quant + "test_backup_resumes_exactly_with_int4_fragments",
        "sync_delay": T + "test_model_average_delay.py::test_kill_with_an_exchange_in_flight_resumes_to_uninterrupted_weights",
        "mix": T + "test_model_average_delay.py::test_kill_with_an_exchange_in_flight_resumes_to_uninterrupted_weights",
        "outer_optimizer": T + "test_model_average.py::test_adam_backup_resumes_exactly[3-True]",
    }
    spark = T + "test_spark.py::test_model_average_period_4_matches_numpy"
    ray = T + "test_ray.py::test_model_average_period_4_matches_numpy"
    for option, tests in launched.items():
        tests = tests if isinstance(tests, tuple) else (tests,)
        pairs[(option, MULTI_NODE)] = Composes((*tests, _NODES))
        pairs[(option, SPARK)] = Composes((*tests, spark))
        pairs[(option, RAY)] = Composes((*tests, ray))
        pairs[(option, MAX_RESTARTS)] = Composes((resumed.get(option, _PAIRS_TEST + (
            f"test_model_average_resumes_from_a_save[{option}]")), _RESTART))
    return pairs


_AVERAGE_OPTIONS = ("period", "warmup_steps", "outer_optimizer", "average_optimizer_state",
                    "fragments", "sync_delay", "mix", "outer_compression", "compression")
# A value of each model-averaging option other than its default (tests and refusals).
_EXAMPLE = {"period": 4, "warmup_steps": 2, "outer_optimizer": "sgd",
            "average_optimizer_state": True, "fragments": 2, "sync_delay": 1, "mix": 0.5,
            "outer_compression": "int8", "compression": "fp16"}

# Options an entry refuses whatever they are paired with.
_SPLIT = {"dense/kernel": (None, "model")}
_TP = T + "test_tensor_parallel.py::"
_TP_LAUNCHED = _TP + "test_two_workers_split_the_model_axis_across_processes[tf]"
_MESH = T + "test_tensor_parallel_mesh.py::"
_MESH_ONE = _MESH + "test_one_process_2_x_2_mesh_matches_one_device"
_MESH_LAUNCHED = _MESH + "test_four_workers_2_x_2_mesh_match_one_device"
_HOROVOD_MESH = (T + "test_tensor_parallel_engines.py::"
                 "test_horovod_2_x_2_mesh_restarts_and_matches_one_process")


def _split_launched_pairs() -> dict:
    """MultiWorkerModelParallelStrategy's pairs: ``layout_map`` is always given."""
    restarted = T + "test_tensor_parallel_features.py::test_a_restarted_job_resumes_split_variables"
    pairs = {
        frozenset({"compression", "layout_map"}): Composes(
            (_TP + "test_compression_casts_the_reduced_payloads", _TP_LAUNCHED),
            note="the same TensorParallelMixin and accounted communicator on one host and "
                 "across workers"),
        ("layout_map", MAX_RESTARTS): Composes(
            (restarted, _RESTART), note="the backup holds the whole weights and slots; a "
                                        "restart splits them again"),
        ("compression", MAX_RESTARTS): Composes(
            (_PAIRS_TEST + "test_compressed_training_resumes_from_a_save", restarted),
            note="a cast on the wire: no state of its own to resume"),
        ("model_parallel", MAX_RESTARTS): Composes(
            (_HOROVOD_MESH, _RESTART), note="the backup holds the whole weights and slots; "
                                            "a restart splits them over the mesh again"),
        frozenset({"layout_map", "model_parallel"}): Composes((_MESH_LAUNCHED,)),
        frozenset({"compression", "model_parallel"}): Composes(
            (_MESH_ONE, _MESH_LAUNCHED),
            note="the same TensorParallelMixin and accounted group collectives on one host "
                 "and across workers"),
        frozenset({"engine", "model_parallel"}): Composes(
            (_MESH_LAUNCHED, _HOROVOD_MESH),
            note="engine 'tf': TF's collective V2 ops within groups; engine 'horovod': "
                 "Horovod's ops within process sets"),
    }
    for mode, mode_test in ((MULTI_NODE, _NODES), (SPARK, _SPARK), (RAY, _RAY)):
        pairs[("model_parallel", mode)] = Composes((_MESH_LAUNCHED, mode_test))
        pairs[("layout_map", mode)] = Composes((_TP_LAUNCHED, mode_test))
        pairs[("compression", mode)] = Composes(
            (_TP_LAUNCHED, T + "test_communication.py::"
             "test_multi_worker_accumulate_and_compression", mode_test))
    pairs[("layout_map", MULTI_NODE)] = Composes(
        (T + "test_tensor_parallel_features.py::test_two_hosts_split_the_model_axis",))
    return pairs


_NO_ACCUMULATION = Refused("ModelParallelStrategy does not accumulate gradients",
                           {"layout_map": _SPLIT, "accumulate_steps": 2})
ALONE = {"multi_worker_model_parallel": {
    "accumulate_steps": _NO_ACCUMULATION,
    "shard_optimizer_state": Refused("does not shard optimizer state",
                                     {"layout_map": _SPLIT, "shard_optimizer_state": True}),
    # Kernels are sharded over the batch axis by their layout ("batch", "model"), not
    # by multi_worker's flag (tests/test_tensor_parallel_fsdp.py).
    "shard_parameters": Refused("shards parameters over the batch axis from its layout "
                                "map only",
                                {"layout_map": _SPLIT, "shard_parameters": True})},
    "model_average": {
    "accumulate_steps": Refused("accumulate_steps is for the synchronous strategies",
                                {"accumulate_steps": 2}),
    "shard_optimizer_state": Refused("shard_optimizer_state is for the synchronous "
                                     "strategies", {"shard_optimizer_state": True}),
    "shard_parameters": Refused("shard_parameters is for the synchronous strategies",
                                {"shard_parameters": True})}}

PAIRS: dict[str, dict] = {
    "mirrored": _sync_pairs(False),
    "horovod": {frozenset({"accumulate_steps", "compression"}): Composes(
        (T + "test_horovod.py::test_accumulate_steps_equals_the_larger_batch",
         T + "test_horovod.py::test_compression_within_tolerance_and_counts_fewer_bytes",
         T + "test_communication.py::test_multi_worker_accumulate_and_compression"),
        note="HorovodStrategy sums and compresses through the same SyncGradientsMixin as "
             "MultiWorkerMirroredStrategy, whose test combines the two")},
    "multi_worker": _sync_pairs(True),
    "parameter_server": {},
    "model_average": _average_pairs(),
    "multi_worker_model_parallel": _split_launched_pairs(),
    "model_parallel": {
        frozenset({"compression", "layout_map"}): Composes(
            (T + "test_tensor_parallel.py::test_compression_casts_the_reduced_payloads",)),
        frozenset({"accumulate_steps", "layout_map"}): Refused(
            "ModelParallelStrategy does not accumulate gradients",
            {"layout_map": {"dense/kernel": (None, "model")}, "accumulate_steps": 2}),
        frozenset({"accumulate_steps", "compression"}): Refused(
            "ModelParallelStrategy does not accumulate gradients",
            {"layout_map": {"dense/kernel": (None, "model")}, "accumulate_steps": 2,
             "compression": "fp16"}),
        frozenset({"accumulate_steps", "model_parallel"}): Refused(
            "ModelParallelStrategy does not accumulate gradients",
            {"layout_map": _SPLIT, "accumulate_steps": 2, "model_parallel": 1}),
        frozenset({"compression", "model_parallel"}): Composes((_MESH_ONE,)),
        frozenset({"layout_map", "model_parallel"}): Composes((_MESH_ONE,))},
}
