"""The prepared GPU call on CPU: ``benchmarks.gpu_side_by_side`` end to end at tiny size (the ALST side through
DeepSpeed's pieces, ours and ours+all through ``L.Trainer``, a probe in its own process, the report), so the call
cannot die of a Python error; and ``scripts/gpu_check.sh`` parses and its steps' time caps fit its budget."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from benchmarks import gpu_side_by_side

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = REPO_ROOT / "scripts" / "gpu_check.sh"


def test_side_by_side_on_cpu(tmp_path: Path) -> None:
    """Every side trains its steps at the two lengths from the ``save_pretrained`` folder; one probe per probed side
    runs and is judged against the capacity; the report has a row per side and the full-depth estimate."""
    capacity_gib = 4.0
    records = gpu_side_by_side.main(
        ["--accelerator", "cpu", "--model", "tiny", "--layers", "1", "--seq-len", "128", "--short-len", "64",
         "--timed-steps", "1", "--budget-s", "900", "--capacity-gib", str(capacity_gib), "--max-probes", "1",
         "--probe-granule", "64", "--probe-first", "192", "--probe-sides", "alst",
         "--out-dir", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "checkpoints")]
    )  # fmt: skip
    assert (tmp_path / "checkpoints" / "tiny-1" / "config.json").is_file()
    sides = {r["side"]: r for r in records if r["kind"] == "side"}
    assert list(sides) == list(gpu_side_by_side.SIDES)
    for side, record in sides.items():
        assert "error" not in record, (side, record)
        assert [s["seq_len"] for s in record["steps"]] == [128, 64, 128], side
        assert all(s["seconds"] > 0 and s["peak"] > 0 for s in record["steps"]), side
        assert record["flops_per_token"]["128"] > record["flops_per_token"]["64"] > 0, side  # causal attention grows
    probes = [r for r in records if r["kind"] in ("probe", "probe_skipped")]
    assert [(p["kind"], p["side"], p["seq_len"]) for p in probes] == [("probe", "alst", 192)]
    assert probes[0]["fits"] == (probes[0]["peak"] is not None and probes[0]["peak"] <= capacity_gib * 2**30)
    report = (tmp_path / "out" / "side_by_side.md").read_text()
    for side in gpu_side_by_side.SIDES:
        assert f"| {side} | " in report
    assert "What this implies for all 2 layers" in report
    assert "Longest sequence, probed" in report


def test_probe_lengths() -> None:
    """Up by an eighth while all fit, down while none does, then bisection to the granule."""
    assert gpu_side_by_side.next_length([65536], [], 65536, 1024) == 65536 + 8192
    assert gpu_side_by_side.next_length([], [65536], 65536, 1024) == 65536 - 8192
    assert gpu_side_by_side.next_length([65536], [73728], 65536, 1024) == 69632
    assert gpu_side_by_side.next_length([65536], [66560], 65536, 1024) is None


def test_gpu_check_parses_and_fits_its_budget() -> None:
    """``bash -n`` accepts the script, and the time caps of its steps (plus ~20 s for the untimed environment
    record) fit BUDGET_S, which leaves the device call's 590 s room for the machine's start-up work."""
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)
    text = GPU_CHECK.read_text()
    defaults = {name: int(value) for name, value in re.findall(r"^(\w+)=\$\{\1:-(\d+)\}", text, re.M)}
    caps = {}
    for name, cap in re.findall(r"^\s*step (\w+) (\S+) ", text, re.M):
        caps[name] = int(cap) if cap.isdigit() else defaults[cap.strip('"${}')]
    assert list(caps) == ["install", "cuda_tests", "sbs_1b", "sbs_8b", "kernels"]
    assert sum(caps.values()) + 20 <= defaults["BUDGET_S"] <= 540
