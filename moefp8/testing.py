"""Helpers shared by the tests and the benchmark tools: error metrics, timing, results JSON."""

import datetime
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parent.parent


def rel_err(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (NaN never passes)."""
    out, ref = out.detach().double(), ref.detach().double()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return float("inf")
    n = ref.norm()
    return float((out - ref).norm() / n) if n > 0 else float((out - ref).norm())


def sqnr(x: Tensor, ref: Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of x against ref."""
    ref = ref.detach().double()
    noise = (x.detach().double() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise)) if noise > 0 else float("inf")


def bench(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of fn() in milliseconds (CUDA: triton's do_bench with L2 flush; CPU: wall clock)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    import time

    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000
    while time.perf_counter() < deadline or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def saved_bytes(fn):
    """(bytes of the distinct tensors autograd saves while fn runs, fn's result); parameters
    are not counted (they are not activations)."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[(t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeat: int = 1) -> float:
    """Measured device-to-device copy bandwidth of `nbytes`, GB/s counting bytes read + written
    (the best of `repeat` medians)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    ms = min(bench(lambda: dst.copy_(src)) for _ in range(max(repeat, 1)))
    return 2 * nbytes / ms / 1e6


# nvidia-smi's clocks event ("throttle") reason bits (NVML nvmlClocksEventReasons)
CLOCK_REASONS = {0x1: "gpu idle", 0x2: "applications clocks", 0x4: "sw power cap", 0x8: "hw slowdown",
                 0x10: "sync boost", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake",
                 0x100: "display clocks"}
_GPU_FIELDS = "index,clocks.sm,clocks.mem,power.draw,temperature.gpu,{}"
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer name first


def parse_gpu_samples(csv: str) -> dict[int, dict]:
    """nvidia-smi --query-gpu=index,clocks.sm,clocks.mem,power.draw,temperature.gpu,<reasons>
    --format=csv,noheader,nounits lines -> per GPU index: samples, SM clock (median, min) and memory
    clock (median) in MHz, power (median, max) in W, the highest temperature, and the names of the
    clock reasons seen in any sample (GPU idle left out: it only says the GPU waited)."""
    import statistics

    per: dict[int, list] = {}
    for line in csv.strip().splitlines():
        f = [v.strip() for v in line.split(",")]
        if len(f) != 6 or not f[0].isdigit():
            continue
        try:
            per.setdefault(int(f[0]), []).append((float(f[1]), float(f[2]), float(f[3]), float(f[4]), int(f[5], 16)))
        except ValueError:  # "[N/A]" and the like
            continue
    out = {}
    for gpu, rows in sorted(per.items()):
        sm, mem, pw, temp, why = zip(*rows)
        bits = 0
        for w in why:
            bits |= w
        out[gpu] = {"samples": len(rows), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
                    "mem_mhz_median": statistics.median(mem), "power_w_median": statistics.median(pw),
                    "power_w_max": max(pw), "temp_c_max": max(temp),
                    "clock_reasons": [n for b, n in CLOCK_REASONS.items() if bits & b and b != 0x1]}
    return out


class GpuSampler:
    """Samples every GPU's clocks, power, temperature and clock reasons with nvidia-smi every `ms`
    while the block runs: ``with GpuSampler() as s: ...`` then ``s.summary`` (parse_gpu_samples'
    dict; {} where nvidia-smi is missing or refuses the query, e.g. on CPU)."""

    def __init__(self, ms: int = 50):
        self.ms, self.proc, self.summary = ms, None, {}

    def __enter__(self):
        import shutil

        exe = shutil.which("nvidia-smi")
        for reasons in _REASON_FIELDS if exe else ():
            q = [exe, f"--query-gpu={_GPU_FIELDS.format(reasons)}", "--format=csv,noheader,nounits"]
            if subprocess.run(q, capture_output=True, text=True).returncode == 0:
                self.proc = subprocess.Popen(q + [f"--loop-ms={self.ms}"], stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, text=True)
                break
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate()
            self.summary = parse_gpu_samples(out)
        return False


def git_commit() -> str:
    """HEAD's short hash (+ "-dirty"); MOEFP8_COMMIT overrides it where the checkout has no .git
    (the device machine receives a copy of the working tree without it)."""
    if os.environ.get("MOEFP8_COMMIT"):
        return os.environ["MOEFP8_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def torchrun_worker_pid(launcher_pid: int, local_rank: int) -> int | None:
    """The torchrun worker with LOCAL_RANK=local_rank among the launcher's descendants (/proc)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            stat = (d / "stat").read_text().split()
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env and b"moefp8.train" in (d / "cmdline").read_bytes():
            pid = int(d.name)
            ppid = int(stat[3])
            while ppid > 1:  # walk up to the launcher
                if ppid == launcher_pid:
                    return pid
                try:
                    ppid = int((Path("/proc") / str(ppid) / "stat").read_text().split()[3])
                except OSError:
                    break
    return None


def boot_id() -> str:
    """This machine's boot id (Linux; "" elsewhere): tells machines apart where every host has the
    same name (the lent GPU machines are all "vm"), and a reboot of one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        return ""


def results_path(name: str, ep: int | None = None) -> Path:
    """bench/results/<name>-<device>[-ep<N>].json (docs/design.md §6); CPU runs go to outputs/."""
    dev = device_name().replace(" ", "-")
    folder = REPO / ("bench/results" if torch.cuda.is_available() else "outputs")
    return folder / f"{name}-{dev}{f'-ep{ep}' if ep else ''}.json"


def save_results(tool: str, rows: list[dict], peak: dict, path: Path | None = None, **extra) -> Path:
    """Writes the docs/design.md §6 results JSON and returns its path."""
    path = Path(path) if path else results_path(tool.removeprefix("bench_"))
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "tool": tool,
        "device": device_name(),
        "gpus": torch.cuda.device_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "command": " ".join(["python"] + [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        "peak": peak,
        **extra,
        "rows": rows,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    """Plain fixed-width table (the last thing a benchmark prints)."""
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) and abs(v) < 10 else (f"{v:.1f}" if isinstance(v, float) else str(v))


def scale_storage(s: torch.Tensor) -> tuple:
    """The memory order of a scale grid: its strides along the dimensions longer than 1."""
    return tuple(st for n, st in zip(s.shape, s.stride()) if n > 1)


def assert_fp8_equal(got, ref, exact: bool, scale_rtol: float = 0.0) -> None:
    """Fp8Tensors equal: layouts, shapes, scales (bit for bit, or within scale_rtol) and FP8 bytes.
    exact=False (Triton's interpreter) allows the interpreter's two known cast bugs and nothing
    else: ties rounded away from zero (one code step) and a value just under a power of two
    dropping to the binade below (half the reference value)."""
    assert got.layout == ref.layout and got.data.dtype == torch.float8_e4m3fn
    assert got.data.shape == ref.data.shape and got.scale.shape == ref.scale.shape
    assert scale_storage(got.scale) == scale_storage(ref.scale), (
        f"scale storage differs: strides {got.scale.stride()} vs {ref.scale.stride()} for shape {tuple(ref.scale.shape)}")
    gs, rs = got.scale.cpu(), ref.scale.cpu()
    if scale_rtol:
        assert torch.allclose(gs, rs, rtol=scale_rtol, atol=0, equal_nan=True)
    else:
        assert torch.equal(gs.nan_to_num(-1.0), rs.nan_to_num(-1.0)), "scales differ"
    gb, rb = got.data.cpu().view(torch.uint8), ref.data.cpu().view(torch.uint8)
    if exact:
        assert torch.equal(gb, rb), f"{(gb != rb).sum().item()} of {gb.numel()} FP8 bytes differ"
        return
    g, r = got.data.cpu().float(), ref.data.cpu().float()
    bad = gb != rb
    same_sign = (gb >> 7) == (rb >> 7)
    one_step = (gb.int() - rb.int()).abs() == 1
    r_pow2 = torch.frexp(r.abs())[0] == 0.5
    binade_drop = r_pow2 & (g.abs() * 2 == r.abs())
    unexplained = bad & ~(same_sign & (one_step | binade_drop))
    assert not unexplained.any(), (f"{unexplained.sum().item()} FP8 values differ beyond the interpreter's cast "
                                   f"bugs, e.g. got {g[unexplained][:4].tolist()} want {r[unexplained][:4].tolist()}")


def _group_entry(rank, world, init, backend, fn, args):
    import datetime

    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # several processes on a small CPU runner: no oversubscription
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, "cuda" if backend == "nccl" else "cpu", *args)
        dist.barrier()
    except BaseException:
        # Report now and leave without teardown: the peers may be blocked in a collective (or a
        # DeepEP kernel) this rank will never join, and destroying the group or a DeepEP buffer
        # waits on them, which hid the error behind a hang. spawn_group then stops the others.
        report = f"rank {rank} of {world} failed:\n{traceback.format_exc()}"
        print(report, file=sys.stderr, flush=True)
        Path(init.removeprefix("file://")).with_name(f"rank{rank}.err").write_text(report)
        os._exit(1)
    dist.destroy_process_group()


def _joined(ctx, folder: str) -> bool:
    """ctx.join(1), a failed rank's exit turned into an error carrying its traceback."""
    try:
        return ctx.join(timeout=1)
    except Exception as e:  # ProcessExitedException / ProcessRaisedException: the others are killed
        reports = sorted(Path(folder).glob("rank*.err"))
        if not reports:
            raise
        raise RuntimeError("\n".join(r.read_text() for r in reports)) from e


def spawn_group(fn, world: int, *args, backend: str = "gloo", timeout_s: float = 120) -> None:
    """Runs fn(rank, world, device, *args) in `world` fresh processes joined in a process group
    (gloo on CPU, nccl one GPU each); raises RuntimeError carrying the failed ranks' tracebacks
    as soon as one fails (the others are stopped), or TimeoutError after timeout_s (never hangs).
    fn must be importable (a module-level function)."""
    import tempfile
    import time

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'init')}"
        ctx = mp.start_processes(_group_entry, args=(world, init, backend, fn, args), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not _joined(ctx, d):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout_s} s")
