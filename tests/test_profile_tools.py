"""benchmarks/profile_train_step.py's idle-gap report, on a hand-made Chrome trace (the GPU path needs a profile from
a GPU; this checks how it reads one): which gaps count, which are host-bound, and which host op they go to."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import profile_train_step  # noqa: E402


class FakeProfile:
    def __init__(self, events):
        self.events = events

    def export_chrome_trace(self, path):
        Path(path).write_text(json.dumps({"traceEvents": self.events}))


def op(name, tid, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "tid": tid, "ts": ts, "dur": dur}


def launch(correlation, tid, ts, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": "launch", "tid": tid, "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}


def kernel(name, correlation, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}


def test_idle_gaps_by_launching_op(capsys):
    events = [
        op("aten::linear", 1, 0, 20), op("aten::mm", 1, 1, 15), launch(1, 1, 5),
        kernel("gemm", 1, 10, 100),  # busy 10..110
        # launched at 50, while the GPU was busy: it waits (here 10 us) for something else, not for the host
        op("aten::add", 1, 45, 10), launch(2, 1, 50), kernel("add_kernel", 2, 120, 10),  # busy until 130
        # launched by a Triton kernel (driver API) at 400, after the GPU went idle at 130: host-bound, 300 us
        op("FlashAttnFunction", 2, 200, 300), launch(3, 2, 400, cat="cuda_driver"),
        kernel("attn_fwd_kernel", 3, 430, 50),
        kernel("tiny", 4, 481, 1),  # 1 us after the last: back to back, not a gap
    ]
    profile_train_step.report_idle(FakeProfile(events), steps=1, top=5)
    out = capsys.readouterr().out
    assert "0.3 ms per step, 0.3 of it host-bound" in out, out
    assert "0.30 ms  host  FlashAttnFunction" in out, out
    assert "0.01 ms  wait  aten::add" in out, out
    assert "tiny" not in out, out


def test_collectives_beside_computation(capsys):
    def on(stream, name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "tid": stream, "ts": ts, "dur": dur}

    device = [
        on(7, "gemm", 0, 100), on(7, "attn_fwd_kernel", 150, 50),  # compute on stream 7: 0..100, 150..200
        on(9, "ncclDevKernel_AllGather_RING_LL", 50, 80),  # 50..130: 50 beside the gemm, 30 exposed
        on(9, "ncclDevKernel_ReduceScatter_RING_LL", 180, 40),  # 180..220: 20 beside attention, 20 exposed
        on(11, "attn_bwd_dq_kernel", 90, 20),  # a side stream's kernel: 90..110 adds 10 beside the gather
    ]
    comm_us, hidden_us = profile_train_step.report_overlap(sorted(device, key=lambda e: e["ts"]), steps=1)
    out = capsys.readouterr().out
    # collectives busy 50..130 and 180..220 (120 us); beside computation 50..110 and 180..200 (80 us)
    assert (comm_us, hidden_us) == (120, 80), (comm_us, hidden_us)
    assert "stream 9: 0.1 ms (communication 0.1)" in out, out
    assert "stream 11: 0.0 ms (attention 0.0)" in out, out
