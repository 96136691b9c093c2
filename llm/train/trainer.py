"""The training loop. It never branches on the strategy: everything parallel goes through
the strategy protocol (llm/parallel/strategy.py)."""

from __future__ import annotations

import math
import signal
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llm.config import Config
from llm.data import IGNORE
from llm.dist import gather_object
from llm.memory import PeakTracker, peak_rss_bytes
from llm.parallel.step import StepResult
from llm.train.checkpoint import Checkpointer
from llm.train.metrics import StepTimer, mfu
from llm.train.monitor import Monitor


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    last_loss: float | None = None
    last_val_loss: float | None = None
    tokens_per_sec: list[float] = field(default_factory=list)
    comm_per_step: dict[str, int] = field(default_factory=dict)
    comm_steps: int = 0
    skipped_steps: int = 0  # overflowing steps the strategy did not apply


def _total(peak: dict | None) -> int | None:
    return None if peak is None else peak["total"]


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: exp of a diverged loss overflows


def _all_reduce_sum(values: list, device: torch.device) -> list[float]:
    """Sum floats or 0-d tensors over ranks in one collective (one host sync)."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


class StopRequested:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and exits at the next step
    boundary (Slurm preemption sends SIGTERM some time before SIGKILL)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        model,
        strategy,
        scheduler,
        train_loader,
        val_loader,
        logger,
        checkpointer: Checkpointer | None,
        flops_per_token: float,
        peak_flops: float | None,
        device: torch.device,
        tracker: PeakTracker | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.strategy = strategy
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.logger = logger
        self.checkpointer = checkpointer
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.device = device
        self.monitor = Monitor(cfg.monitor)
        self.state = TrainState()
        self.model_state_bytes: dict[str, int] = {}
        self.dp_size = strategy.dims.dp_size
        # llm.run hands over the tracker that measured start-up, so the run has one.
        self.tracker = tracker or PeakTracker(device, cfg.train.memory_tracking)
        self.tracker.watch(strategy.state_tensors)

    # ---- checkpoint state -------------------------------------------------------------
    def trainer_state(self) -> dict:
        return {
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "skipped_steps": self.state.skipped_steps,
            "scheduler": self.scheduler.state_dict(),
            "data": self.train_loader.state_dict(),
        }

    def resume(self, path) -> None:
        with self.tracker.region("checkpoint_load"):
            saved = self.checkpointer.load(path, self.strategy)
        self.state.step = saved["step"]
        self.state.tokens_seen = saved["tokens_seen"]
        self.state.skipped_steps = saved.get("skipped_steps", 0)
        self.scheduler.load_state_dict(saved["scheduler"])
        self.train_loader.load_state_dict(saved["data"])
        self.logger.info(f"resumed from {path} at step {self.state.step}")

    def save(self) -> None:
        if self.checkpointer is not None:
            with self.tracker.region("checkpoint_save"):
                path = self.checkpointer.save(self.state.step, self.strategy, self.trainer_state())
            self.logger.info(f"saved checkpoint {path}")

    # ---- one step ---------------------------------------------------------------------
    def _loss_sum(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.strategy.precision.autocast(self.device):
            logits = self.model(input_ids)  # (B, T, V)
        return F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        )

    def train_step(self, timer: StepTimer, stop: StopRequested) -> tuple[float, StepResult, bool]:
        """One optimizer step over grad_accum_steps micro-batches. Returns (loss, the
        strategy's step result, stop requested on any rank)."""
        with timer.data():
            batches = [next(self.train_loader) for _ in range(self.cfg.train.grad_accum_steps)]
        # Counted on the host copies: no device sync before the forward.
        local_tokens = sum(int((y != IGNORE).sum()) for _, y in batches)
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        # One tiny collective gives every rank the global target count (for the loss
        # normaliser) and whether any rank was asked to stop.
        global_tokens, stop_votes = _all_reduce_sum(
            [local_tokens, float(stop.requested)], self.device
        )
        # Each rank's gradient is averaged over dp ranks by the strategy, so scaling the
        # summed loss by dp_size / global_tokens yields the per-token mean over the whole
        # accumulated global batch: k micro-batches of b equal one batch of k*b.
        scale = self.dp_size / max(global_tokens, 1.0)
        step = self.state.step + 1
        with self.tracker.step(self.tracker.tracks(logged=self._logs_at(step))):
            loss_sum, result = self._step_on(batches, scale)
            if self._logs_at(step):
                # Sampled while gradients exist: what a rank holds at its peak of model state.
                self.model_state_bytes = self.strategy.memory()
            self.strategy.zero_grad()
        (total,) = _all_reduce_sum([loss_sum], self.device)
        return total / max(global_tokens, 1.0), result, stop_votes > 0

    def _step_on(self, batches: list, scale: float) -> tuple[torch.Tensor, StepResult]:
        """Forward and backward of every micro-batch, then the optimizer step, each a phase
        of the peak tracker. Returns (the summed loss, the strategy's step result)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (x, y) in enumerate(batches):
            with self.strategy.micro_batch(sync=i == len(batches) - 1):
                self.tracker.phase("forward")
                loss = self._loss_sum(x, y)
                self.tracker.phase("backward")
                scaled = loss * scale
                self.tracker.watch_backward(scaled)
                self.strategy.backward(scaled)
            # The micro-batch's exit (a strategy's end-of-backward reduction) is backward too.
            loss_sum += loss.detach()  # no .item(): a host sync per micro-batch stalls a GPU
        self.tracker.phase("optimizer_step")
        result = self.strategy.clip_and_step(self.cfg.train.grad_clip)
        self.scheduler.step()
        return loss_sum, result

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for x, y in self.val_loader:
            x, y = x.to(self.device), y.to(self.device)
            loss_sum += self._loss_sum(x, y)
            tokens += (y != IGNORE).sum()
        self.model.train()
        loss_sum, tokens = _all_reduce_sum([loss_sum, tokens], self.device)
        return loss_sum / max(tokens, 1.0)

    # ---- the loop ---------------------------------------------------------------------
    def fit(self) -> dict:
        t = self.cfg.train
        tokens_per_step = (
            t.micro_batch_size * t.grad_accum_steps * self.dp_size * self.cfg.data.seq_len
        )
        timer = StepTimer(self.device)
        last = t.stop_at_step or t.max_steps
        self.model.train()
        with StopRequested() as stop:
            while self.state.step < last:
                with timer.step():
                    loss, result, stop_now = self.train_step(timer, stop)
                self.state.step += 1
                self.state.tokens_seen += tokens_per_step
                self.state.last_loss = loss
                self._account(timer, tokens_per_step)
                self.state.skipped_steps += result.skipped
                metrics = {
                    "loss": loss,
                    "grad_norm": result.grad_norm,
                    "loss_scale": result.loss_scale,
                    "skipped": result.skipped,
                    "skipped_steps": self.state.skipped_steps,
                }
                for alert in self.monitor.check(self.state.step, metrics):
                    self.logger.alert(alert)
                self.logger.advance(self.state.step, loss, self._last_tps())
                if self._logs_at(self.state.step):
                    self.logger.log(self.state.step, self._log_metrics(metrics, timer))
                if self.state.step % t.eval_every == 0 and self.state.step < t.max_steps:
                    self._eval_and_log()
                every = self.cfg.checkpoint.every
                if every and self.state.step % every == 0 and self.state.step < t.max_steps:
                    self.save()
                if stop_now:
                    self.logger.info(f"stop requested: checkpointing at step {self.state.step}")
                    self.save()
                    return self.summary(stopped=True)
        self._eval_and_log()
        self.save()
        return self.summary(stopped=self.state.step < t.max_steps)

    def _logs_at(self, step: int) -> bool:
        """Steps whose metrics are logged: the first, every log_every-th and the last."""
        t = self.cfg.train
        return step == 1 or step % t.log_every == 0 or step == (t.stop_at_step or t.max_steps)

    def _mfu(self, tokens_per_sec: float | None) -> float | None:
        if tokens_per_sec is None:
            return None
        # Per GPU: each rank does 1/world of the step's work.
        per_rank = tokens_per_sec / self.strategy.dims.world_size
        return mfu(per_rank, self.flops_per_token, self.peak_flops)

    def _eval_and_log(self) -> None:
        val_loss = self.evaluate()
        self.state.last_val_loss = val_loss
        self.logger.log(
            self.state.step,
            {"val_loss": val_loss, "val_ppl": _perplexity(val_loss)},
        )

    def _last_tps(self) -> float | None:
        return self.state.tokens_per_sec[-1] if self.state.tokens_per_sec else None

    def _account(self, timer: StepTimer, tokens_per_step: int) -> None:
        tps = tokens_per_step / timer.last.step_time_s
        self.state.tokens_per_sec.append(tps)
        for kind, sent in self.strategy.comm().items():
            self.state.comm_per_step[kind] = self.state.comm_per_step.get(kind, 0) + sent
        self.state.comm_steps += 1

    def _log_metrics(self, metrics: dict, timer: StepTimer) -> dict:
        out = dict(metrics)
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["tokens_per_sec"] = self._last_tps()
        out["step_time_s"] = timer.last.step_time_s
        out["data_wait_share"] = timer.last.data_wait_share
        out["mfu"] = self._mfu(self._last_tps())
        out["tokens_seen"] = self.state.tokens_seen
        out.update(self._step_memory())
        for kind, value in self.model_state_bytes.items():
            out[f"memory/{kind}_bytes"] = value
        return out

    def _step_memory(self) -> dict:
        """This step's peaks from every rank: the tracker's (when it tracked the step) and on
        CUDA the allocator's; peak_memory_bytes is the highest, the allocator's on CUDA."""
        ranks = gather_object((self.tracker.last_step, self.tracker.last_cuda_peak))
        out = {}
        if all(peak is not None for peak, _ in ranks):
            out["memory_peak"] = [peak for peak, _ in ranks]
        if self.device.type == "cuda":
            out["cuda_max_allocated_bytes"] = [cuda for _, cuda in ranks]
            out["peak_memory_bytes"] = max(cuda for _, cuda in ranks)
        elif "memory_peak" in out:
            out["peak_memory_bytes"] = max(peak["total"] for peak in out["memory_peak"])
        return out

    def memory_summary(self) -> dict:
        """This rank's peaks over the run; llm.run gathers them from every rank."""
        t = self.tracker
        on_cuda = self.device.type == "cuda"
        phase_max = max((p["total"] for p in t.by_phase.values()), default=None)
        return {
            "memory_peak": t.best_step,
            "memory_peak_by_phase": t.by_phase,
            "peak_memory_bytes": t.cuda_step_peak if on_cuda else _total(t.best_step),
            "max_peak_memory_bytes": t.cuda_run_peak if on_cuda else phase_max,
            "cuda_max_allocated_bytes": t.cuda_step_peak,
            "process_peak_rss_bytes": peak_rss_bytes(),
        }

    def summary(self, stopped: bool) -> dict:
        # Steady-state throughput: drop the first steps (allocator warm-up, compilation).
        tps = self.state.tokens_per_sec[min(3, len(self.state.tokens_per_sec) - 1) :]
        median_tps = statistics.median(tps) if tps else None
        steps = max(self.state.comm_steps, 1)
        return {
            "steps": self.state.step,
            "stopped_early": stopped,
            "final_train_loss": self.state.last_loss,
            "final_val_loss": self.state.last_val_loss,
            "final_val_ppl": (
                _perplexity(self.state.last_val_loss)
                if self.state.last_val_loss is not None
                else None
            ),
            "tokens_seen": self.state.tokens_seen,
            "skipped_steps": self.state.skipped_steps,
            "tokens_per_sec": median_tps,
            "mfu": self._mfu(median_tps),
            **self.memory_summary(),
            "model_state_bytes": self.model_state_bytes,
            "comm_bytes_per_step": {k: v / steps for k, v in self.state.comm_per_step.items()},
        }
