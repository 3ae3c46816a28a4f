"""``profile capture`` output from an NVIDIA H200, checked against the model's own counts.

``tests/data/profiler/moe4_capture_b{1,8}.json.gz`` were written on an H200 (torch 2.11)
by :func:`agentload.profiler.capture.capture` with ``tool="torch"`` (the code path of
``agentload profile capture --tool torch -- python tests/gpu/capture_layer_stack.py``):
four of the kernels room's MoE decoder layers on the eager ``standard`` path, one warm-up
step and 3 decode steps, each layer in a ``layer<i>.standard`` range. The
``*_truth.json`` files hold what each layer launches when profiled alone, counted from
torch's event list in a separate run (``capture_layer_stack.py --count``).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import orjson
import pytest

from tests.support import run_cli

DATA = Path(__file__).parents[1] / "data" / "profiler"
STEPS = 4  # the warm-up step and 3 decode steps: the script runs whole under the profiler


@pytest.mark.parametrize("batch", [1, 8])
def test_captured_trace_counts_match_the_launches(batch: int) -> None:
    trace = DATA / f"moe4_capture_b{batch}.json.gz"
    truth = json.loads((DATA / f"moe4_capture_b{batch}_truth.json").read_text())["kernels"]
    assert set(truth.values()) == {56 if batch == 1 else 170}  # the bench's launch counts
    done = run_cli("profile", "layers", str(trace), "--json")
    rows = {r["name"]: r for r in orjson.loads(done.stdout)["layers"]}
    for name, per_step in truth.items():
        assert rows[name]["instances"] == STEPS, name
        assert rows[name]["kernels"] == STEPS * per_step, name
        # busy also covers the layer's small memcpys, which ``kernels`` does not count
        assert 0 < rows[name]["kernel_ns"] <= rows[name]["busy_ns"] <= rows[name]["span_ns"]


def test_captured_trace_is_from_an_h200() -> None:
    with gzip.open(DATA / "moe4_capture_b1.json.gz") as fh:
        trace = json.loads(fh.read())
    assert [d["name"] for d in trace["deviceProperties"]] == ["NVIDIA H200"]
    assert (DATA / "moe4_capture_b8.json.gz").stat().st_size < 1_000_000


def test_layer_types_and_kernel_names_of_the_capture() -> None:
    from agentload.profiler import attribute, load_profile, summarize
    from agentload.profiler.summary import short_kernel_name

    s = summarize(attribute(load_profile(DATA / "moe4_capture_b1.json.gz")))
    types = {r["type"]: r for r in s.types.iter_rows(named=True)}
    # the four layer<i>.standard ranges are one type: 4 layers x 4 steps x 56 kernels
    assert types["layer*.standard"]["kernels"] == 4 * STEPS * 56
    # names inside an anonymous namespace are not cut at "(anonymous namespace)"
    assert short_kernel_name("void at::native::(anonymous namespace)::cunn_SoftMaxForward"
                             "<4, float>(float*)") == "at::native::cunn_SoftMaxForward"
    assert not [k for k in s.top_kernels["kernel"].to_list() if k.endswith("::")]



def test_steps_of_the_capture_use_its_layer_ranges() -> None:
    """``layer<i>.standard`` ranges are layer ranges: decode steps hold 4 layers of 56
    kernels each, nothing is inferred (an inferred split found 57-kernel periods)."""
    done = run_cli("profile", "steps", str(DATA / "moe4_capture_b1.json.gz"), "--json")
    assert "inferred" not in done.stdout + done.stderr
    decode = [s for s in orjson.loads(done.stdout)["steps"] if s["step"] == "decode_step"]
    assert len(decode) == STEPS - 1
    assert all(s["layers"] == 4 and s["kernels"] == 4 * 56 for s in decode)
