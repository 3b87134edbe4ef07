"""Property-based fuzzing of TF_CONFIG parsing: only clear ValueErrors come out."""

import pytest
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tfdist.cluster import TASK_TYPES, ClusterSpec

_addresses = st.one_of(
    st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["127.0.0.1", "localhost", "w-1",
                                                        "10.0.0.2", "[::1]", ""]),
              st.integers(-1, 70000)),
    st.text(max_size=12), st.integers(), st.none())
_jobs = st.dictionaries(st.sampled_from(list(TASK_TYPES) + ["master", "Worker"]),
                        st.one_of(st.lists(_addresses, max_size=3), _addresses,
                                  st.dictionaries(st.text(max_size=2), _addresses,
                                                  max_size=2)),
                        max_size=4)
_task = st.one_of(st.none(), st.fixed_dictionaries(
    {"type": st.sampled_from(list(TASK_TYPES) + ["boss", 3]),
     "index": st.one_of(st.integers(-2, 4), st.text(max_size=2), st.booleans())}),
    st.text(max_size=4))


@pytest.mark.unit
@settings(max_examples=500, deadline=None)
@given(st.fixed_dictionaries({"cluster": _jobs}, optional={"task": _task,
                                                           "extra": st.integers()}))
def test_fuzzed_tf_config_gives_value_errors_only(config):
    try:
        spec = ClusterSpec.from_json(json.dumps(config))
    except ValueError as error:
        assert str(error)
        return
    # Whatever parses round-trips exactly.
    assert ClusterSpec.from_json(spec.to_tf_config()) == spec


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_fuzzed_tf_config_text_gives_value_errors_only(text):
    try:
        ClusterSpec.from_json(text)
    except ValueError:
        pass
