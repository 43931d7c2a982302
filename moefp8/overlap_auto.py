"""`dispatch.overlap=auto` (issue 48): the two micro-batch overlap kept only where it measures faster.

Whether splitting each micro-batch in two and hiding one half's exchanges under the other's compute
pays depends on the model's shape, the EP size, the transport and the host (bench/notes/overlap.md:
1.07x at EP8 on one block, 0.7-0.8x of the plain step at EP4 on the small and 16B-class presets).
No model of it has been validated, so it is measured where it runs: the first training steps
alternate the schedules, plain then overlapped, `warmup` rounds not counted (each schedule's first
steps compile and autotune its shapes), then `rounds` counted ones. Each step's time (to the loop's
one host sync, the optimizer step included) is averaged over all ranks, so every rank of every EP
group sees the same figures and keeps the same schedule (they must agree: moefp8.moe.MoELayer). The one
with the lower median is kept for the rest of the run and the decision printed with both medians.

The measured steps are ordinary training steps: the two schedules compute the same layer (the
overlap splits the micro-batch; its FP8 column-wise tiles for the weight gradients then hold other
rows, so the two are not bit-identical), and the run goes on from them. A resumed run measures again.

    auto = OverlapAuto(model, OverlapPolicy(), all_reduce=par.all_reduce_, world=par.world, say=print)
    for step in ...:
        auto.begin_step()                # sets the model's schedule for this step
        ... one training step, seconds dt ...
        auto.end_step(dt)                # after the last counted round: decides, prints, keeps it
"""

import statistics

import torch

from moefp8.overlap import OverlapPolicy


class OverlapAuto:
    """model: a `moefp8.model.Transformer` built with the capacity for the whole micro-batch (see
    `set_overlap`); policy: the overlapped schedule's `OverlapPolicy`; all_reduce: sums a tensor
    over all ranks in place (identity on one process); world: the number of ranks; say: prints the
    decision; on_switch(schedule): called with "off" / "on" whenever the schedule is set (the
    dispatcher's capacity follows it: the overlap's micro-batches are halves, and the capacity mode
    moves whole capacity blocks); device: where the times are all-reduced (the process group's, `Parallel.device`:
    an NCCL group has no CPU backend)."""

    SCHEDULES = ("off", "on")

    def __init__(self, model, policy: OverlapPolicy, warmup: int = 1, rounds: int = 3, all_reduce=None,
                 world: int = 1, say=print, on_switch=None, device: torch.device | str = "cpu"):
        if warmup < 0 or rounds < 1:
            raise ValueError(f"OverlapAuto: warmup={warmup} must be >= 0 and rounds={rounds} >= 1")
        self.model, self.policy, self.warmup, self.rounds = model, policy, warmup, rounds
        self.all_reduce, self.world, self.say = all_reduce or (lambda x: x), world, say
        self.on_switch, self.device = on_switch or (lambda schedule: None), torch.device(device)
        self.times = {s: [] for s in self.SCHEDULES}
        self.step, self.choice, self.medians = 0, None, None  # once decided: "off" / "on", {schedule: s}

    @property
    def trial_steps(self) -> int:
        return 2 * (self.warmup + self.rounds)

    def _schedule(self) -> str:
        return self.choice or self.SCHEDULES[self.step % 2]

    def _apply(self, schedule: str) -> None:
        self.model.set_overlap(self.policy if schedule == "on" else None)
        self.on_switch(schedule)

    def begin_step(self) -> None:
        if self.choice is None:
            self._apply(self._schedule())

    def end_step(self, seconds: float) -> None:
        if self.choice is not None:
            return
        if self.step >= 2 * self.warmup:
            self.times[self._schedule()].append(seconds)
        self.step += 1
        if self.step == self.trial_steps:
            self._decide()

    def _decide(self) -> None:
        t = torch.tensor([self.times[s] for s in self.SCHEDULES], dtype=torch.float64, device=self.device)  # [2, rounds]
        t = (self.all_reduce(t) / self.world).cpu()  # the mean over the ranks: the same figures everywhere
        med = self.medians = {s: statistics.median(t[i].tolist()) for i, s in enumerate(self.SCHEDULES)}
        self.choice = "on" if med["on"] < med["off"] else "off"
        self._apply(self.choice)
        if self.device.type == "cuda":  # the trials' cached blocks (the overlap peaks ~40% higher) back to the driver
            torch.cuda.empty_cache()
        n = len(self.times["on"])
        self.say(f"dispatch.overlap=auto: {self.choice} from now on (step time, median of {n} steps each, mean "
                 f"over ranks: off {med['off'] * 1e3:.1f} ms, on {med['on'] * 1e3:.1f} ms; "
                 f"on/off {med['on'] / med['off']:.3f})")
