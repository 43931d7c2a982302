"""moefp8.testing's helpers that the benchmarks lean on (CPU)."""

from moefp8.testing import GpuSampler, parse_gpu_samples


def test_parse_gpu_samples():
    """nvidia-smi CSV samples -> per-GPU summary: medians, minima, maxima, clock reasons by name
    (GPU idle left out), malformed and [N/A] lines skipped."""
    csv = "\n".join([
        "0, 1980, 3201, 650.5, 61, 0x0000000000000000",
        "0, 1755, 3201, 700.1, 66, 0x0000000000000004",  # sw power cap
        "0, 1980, 3201, 655.0, 63, 0x0000000000000001",  # idle: not reported
        "1, 1980, 3201, 400.0, 50, 0x0000000000000000",
        "1, [N/A], 3201, 400.0, 50, 0x0000000000000000",
        "garbage",
    ])
    s = parse_gpu_samples(csv)
    assert sorted(s) == [0, 1]
    g0, g1 = s[0], s[1]
    assert g0["samples"] == 3 and g0["sm_mhz_median"] == 1980 and g0["sm_mhz_min"] == 1755
    assert g0["power_w_max"] == 700.1 and g0["power_w_median"] == 655.0 and g0["temp_c_max"] == 66
    assert g0["clock_reasons"] == ["sw power cap"]
    assert g1["samples"] == 1 and g1["clock_reasons"] == []
    assert parse_gpu_samples("") == {}


def test_gpu_sampler_without_nvidia_smi(monkeypatch):
    """Where nvidia-smi is missing the sampler is a no-op with an empty summary."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with GpuSampler(ms=10) as s:
        pass
    assert s.summary == {}


def test_gpu_sampler_with_a_fake_nvidia_smi(tmp_path, monkeypatch):
    """The sampler probes the newer clock-reason field name, falls back to the older one where the
    driver refuses it, samples until the block ends and summarizes what it read."""
    import os
    import time

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    'case "$1" in *clocks_event_reasons*) echo "Field is not a valid field" >&2; exit 2;; esac\n'
                    'case "$*" in *--loop-ms=*) while true; do echo "0, 1980, 3201, 650, 60, 0x4"; sleep 0.01; done;; '
                    'esac\necho "0, 1980, 3201, 650, 60, 0x0"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuSampler(ms=10) as s:
        time.sleep(0.3)
    assert s.summary[0]["samples"] >= 2 and s.summary[0]["clock_reasons"] == ["sw power cap"]
