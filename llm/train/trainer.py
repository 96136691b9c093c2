"""The training loop. It never branches on the strategy: everything parallel goes through
the strategy protocol (llm/parallel/strategy.py).

Steps that are not logged do not wait for the device: the loss, the global target-token
count, the gradient norm and the step time stay on the device (CUDA events for the time)
and are read together, in one host sync, on logged steps, before a checkpoint, on a stop
and at the end (``_read_pending``), with whether the step was skipped where the optimizer
decided that on the device. The stop vote is read at every step boundary without a host
sync (llm/train/stop_vote.py). The monitor then checks every step read. The one read a step
still makes, where the optimizer cannot skip on the device, is the overflow check's
(llm/parallel/step.py).

A step either probes (runs the memory instruments) or is timed, never both
(llm/train/probes.py): step times, tokens/s and MFU come from timed steps only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llm.config import Config
from llm.data import IGNORE, Batch
from llm.errors import TrainingError
from llm.memory import OUTSIDE, ActivationMemoryCounter, PeakTracker, find_layers
from llm.optim import warmup_note
from llm.parallel.dist import global_rank, global_world_size
from llm.parallel.step import StepResult, settle_skip
from llm.parallel.tensor_parallel import local_loss
from llm.recompute import RecomputePolicy
from llm.recompute.policies import NoRecompute
from llm.train.checkpoint import Checkpointer
from llm.train.end_report import comm_summary, memory_summary, run_summary
from llm.train.fp8_watch import Fp8Watch
from llm.train.loss import HeadLoss, head_loss
from llm.train.metrics import StepTimer, mfu, perplexity
from llm.train.moe_stats import MoEStats
from llm.train.monitor import Monitor
from llm.train.probes import ProbeSchedule
from llm.train.rank_peaks import own_rows, read_rows
from llm.train.stop import StopRequested, stop_guard
from llm.train.stop_vote import StopVote
from llm.train.train_state import TrainState


def _activation_metrics(counter: ActivationMemoryCounter) -> dict:
    """This rank's bytes kept for backward by one micro-batch's forward: in total, per
    block (in order) and outside the blocks (embeddings, final norm, head, loss)."""
    per_layer = [n for name, n in counter.by_layer.items() if name != OUTSIDE]
    return {
        "activation_bytes": counter.activation_bytes,
        "activation_bytes_per_layer": per_layer,
        "activation_bytes_outside_layers": counter.by_layer[OUTSIDE],
    }


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed token cross-entropy of (B, T, V) logits, in fp32; padding is ignored."""
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return local_loss(loss)  # tensor parallel: a DTensor, equal on every tp rank


def _plain_loss(train) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``_cross_entropy_sum``, compiled as the model is under ``train.compile``: Inductor
    then reads the compute-dtype logits into the fp32 log-sum-exp in one kernel, where the
    eager loss writes and reads back an fp32 copy of the (B, T, V) logits and runs the fp32
    softmax's backward (torchtitan compiles its loss the same way)."""
    if not train.compile:
        return _cross_entropy_sum
    mode = None if train.compile_mode == "default" else train.compile_mode
    return torch.compile(_cross_entropy_sum, mode=mode)


def _on_device(value, device: torch.device) -> torch.Tensor:
    """A 0-d float64 tensor on ``device``; a number is filled in there (a host-to-device copy
    of it would wait for the stream)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64)
    return torch.full((), value, dtype=torch.float64, device=device)


def _all_reduce_sum(values: list, device: torch.device) -> torch.Tensor:
    """Sum numbers or 0-d tensors over ranks in one collective. The sums stay on the device
    (float64); reading them is the caller's host sync."""
    t = torch.stack([_on_device(v, device) for v in values])
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


@dataclass
class _UnreadStep:
    """What one step leaves for ``_read_pending``, unread."""

    step: int
    loss_sum: torch.Tensor  # this rank's summed loss, not yet all-reduced
    tokens: torch.Tensor  # global target tokens of the step's batch
    stop_votes: torch.Tensor  # ranks asked to stop
    result: StepResult
    probe: bool  # ran the instruments: its time is not reported


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
        flops_per_token: dict[str, float],
        peak_flops: float | None,
        device: torch.device,
        tracker: PeakTracker | None = None,
        recompute: RecomputePolicy | None = None,
        stop: StopRequested | None = None,
    ) -> None:
        self.cfg = cfg
        self._plain_loss = _plain_loss(cfg.train)
        # The process's record of stop signals (llm.train.stop.stop_guard); its handlers stay
        # installed after fit() returns, so the final evaluation and save are covered too.
        self.stop = stop
        self.model = model
        self.strategy = strategy
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.logger = logger
        self.checkpointer = checkpointer
        # Training FLOPs per token by metric name: {"mfu": convention, "mfu_causal": exact}.
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.device = device
        self.monitor = Monitor(cfg.monitor)
        self.state = TrainState()
        self.model_state_bytes: dict[str, int] = {}
        self.dp_size = strategy.dims.dp_size
        # Ranks that read each dp rank's batch (its tensor-parallel and pipeline peers), and
        # ranks that hold its loss (the last pipeline stage's tensor-parallel peers):
        # world-wide sums of token counts and of losses count every batch this many times.
        self.batch_copies = strategy.dims.batch_copies
        self.loss_copies = strategy.dims.loss_copies
        self._pending: list[_UnreadStep] = []
        # Every rank's (tracked peak, CUDA peak) of the last step read (``_read_pending``).
        self._rank_peaks: list[tuple[dict | None, int | None]] = []
        # llm.run hands over the tracker that measured start-up, so the run has one.
        self.tracker = tracker or PeakTracker(
            device, cfg.train.memory_tracking, cfg.train.peak_tensors, cfg.train.allocator_blocks
        )
        self.tracker.watch(strategy.state_tensors)
        self.resumed_from = None  # the checkpoint this invocation started from
        self.stop_signal: str | None = None
        # The recompute policy's context around every training forward (offload, budget).
        self.recompute = recompute or NoRecompute()
        self._layers = find_layers(model)
        # Bytes kept for backward by the first micro-batch of the last probe step.
        self.activations: dict = {}
        self.moe = MoEStats(model, cfg.train.grad_accum_steps)
        self.fp8 = Fp8Watch(model, cfg.precision.fp8_stats_every)
        t = cfg.train
        self.probes = ProbeSchedule(
            t.memory_tracking, t.log_every, t.stop_at_step or t.max_steps, self.fp8.every
        )

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
        for note in self.checkpointer.notes:  # newer checkpoints resolve() skipped, and why
            self.logger.info(note)
        with self.tracker.region("checkpoint_load"):
            saved = self.checkpointer.load(path, self.strategy)
        self.state.step = saved["step"]
        self.state.tokens_seen = saved["tokens_seen"]
        self.state.skipped_steps = saved.get("skipped_steps", 0)
        self.scheduler.load_state_dict(saved["scheduler"])
        self.train_loader.load_state_dict(saved["data"])
        self.resumed_from = path
        self.logger.info(f"resumed from {path} at step {self.state.step}")
        if moved := self.checkpointer.set_aside_newer(path):
            self.logger.info(
                f"moved this run's checkpoints after step {self.state.step} to {moved}: they "
                "belong to the run before this resume"
            )

    def save(self) -> None:
        if self.checkpointer is not None:
            with self.tracker.region("checkpoint_save"):
                path = self.checkpointer.save(self.state.step, self.strategy, self.trainer_state())
            self.logger.info(f"saved checkpoint {path}")

    # ---- one step ---------------------------------------------------------------------
    def _forward_context(self) -> AbstractContextManager:
        """What every training forward runs in: the recompute policy's context and the
        precision's autocast."""
        stack = ExitStack()
        stack.enter_context(self.recompute.forward_context())
        stack.enter_context(self.strategy.precision.autocast(self.device))
        return stack

    def _logits(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None,
        head: HeadLoss | None = None,
    ) -> torch.Tensor:
        """(B, T, V) under the precision's autocast, or what ``head`` (a fused loss) makes of
        the final hidden states in their place; with ``doc_ids`` (attention.document_mask)
        attention stays inside packed documents."""
        extra = {} if doc_ids is None else {"doc_ids": doc_ids}
        if head is not None:
            extra["head"] = head
        with self._forward_context():
            return self.model(input_ids, **extra)

    def _loss_sum(
        self, input_ids: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None
    ) -> torch.Tensor:
        t = self.cfg.train
        if t.fused_loss == "off":
            return self._plain_loss(self._logits(input_ids, doc_ids), targets)
        # train.fused_loss: the model hands its hidden states and head weight to the loss,
        # which never holds the (B*T, V) fp32 logits at once (llm/train/loss.py).
        head = head_loss(t.fused_loss, targets, t.fused_loss_chunk)
        return self._logits(input_ids, doc_ids, head)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # On CUDA the loader hands out pinned batches (llm/data/prefetch.py), so the copy is
        # asynchronous: the host runs on to the forward. On CPU this is ``t`` itself.
        return t.to(self.device, non_blocking=True)

    def _batch_to(self, batch: Batch, copy) -> Batch:
        """The batch with ``copy`` applied to its tensors; document ids only when
        attention.document_mask uses them."""
        docs = batch.doc_ids if self.cfg.attention.document_mask else None
        return Batch(
            copy(batch.input_ids), copy(batch.targets), docs if docs is None else copy(docs)
        )

    def train_step(self, timer: StepTimer, stop: StopRequested) -> _UnreadStep:
        """One optimizer step over grad_accum_steps micro-batches; what it leaves on the
        device is read later (``_read_pending``)."""
        with timer.data():
            batches = [next(self.train_loader) for _ in range(self.cfg.train.grad_accum_steps)]
        batches = [self._batch_to(b, self._to_device) for b in batches]
        local_tokens = torch.stack([(b.targets != IGNORE).sum() for b in batches]).sum()
        # One tiny collective gives every rank the global target count (for the loss
        # normaliser) and whether any rank was asked to stop; both stay on the device.
        counts = _all_reduce_sum([local_tokens, float(stop.requested)], self.device)
        counts[0] /= self.batch_copies
        # Each rank's gradient is averaged over dp ranks by the strategy, so scaling the
        # summed loss by dp_size / global_tokens yields the per-token mean over the whole
        # accumulated global batch: k micro-batches of b equal one batch of k*b.
        scale = (self.dp_size / counts[0].clamp(min=1.0)).float()
        step = self.state.step + 1
        probe = self.probes.probes(step)
        self.strategy.count_comm(probe and self.cfg.parallelism.count_comm)
        self.strategy.measure(probe)
        with self.tracker.step(probe):
            if (extra := self.strategy.gradient_pass(step)) is not None:
                self._gradient_pass(extra, batches, scale, counts[0], step)
            with self.fp8.recording(step):
                loss_sum, result = self._step_on(batches, scale, count=probe)
            if probe:
                # Sampled while gradients exist: what a rank holds at its peak of model state.
                self.model_state_bytes = self.strategy.memory()
            self.strategy.zero_grad()
        return _UnreadStep(step, loss_sum, counts[0], counts[1], result, probe)

    def _step_on(
        self, batches: list, scale: torch.Tensor, count: bool
    ) -> tuple[torch.Tensor, StepResult]:
        """Forward and backward of every micro-batch, then the optimizer step, each a phase
        of the peak tracker. The strategy's schedule runs the micro-batches when it has one
        (a pipeline: forward and backward interleave, one phase); else this loop, where with
        ``count`` what the first micro-batch's forward keeps for backward is counted
        (``self.activations``). Returns (the summed loss, the strategy's step result)."""
        schedule = self.strategy.schedule
        if schedule is not None:
            self.tracker.phase("forward_backward")
            with self.strategy.loss_context():
                loss_sum = schedule.forward_backward(
                    batches, scale, _cross_entropy_sum, self._forward_context
                )
        else:
            loss_sum = self._micro_batches(batches, scale, count)
        self.tracker.phase("optimizer_step")
        result = self.strategy.clip_and_step(self.cfg.train.grad_clip)
        if self.moe:
            self.moe.after_step(result.skipped)
        self.scheduler.step()
        return loss_sum, result

    def _micro_batches(self, batches: list, scale: torch.Tensor, count: bool) -> torch.Tensor:
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (x, y, docs) in enumerate(batches):
            with (
                self.strategy.micro_batch(sync=i == len(batches) - 1),
                self.strategy.loss_context(),
            ):
                self.tracker.phase("forward")
                with self._counter(count and i == 0) as counter:
                    loss = self._loss_sum(x, y, docs)
                if counter is not None:
                    self.activations = _activation_metrics(counter)
                self.tracker.phase("backward")
                scaled = loss * scale
                if self.moe and (aux := self.moe.aux_loss()) is not None:
                    scaled = scaled + aux
                self.tracker.watch_backward(scaled)
                self.strategy.backward(scaled)
            # The micro-batch's exit (a strategy's end-of-backward reduction) is backward too.
            loss_sum += loss.detach()  # no .item(): a host sync per micro-batch stalls a GPU
        return loss_sum

    def _counter(self, on: bool) -> AbstractContextManager:
        """Saved-tensor hooks cost time at every saved tensor: only on probe steps."""
        return ActivationMemoryCounter(self._layers) if on else nullcontext()

    def _gradient_pass(self, extra, batches: list, scale, tokens, step: int) -> None:
        """The optimizer's extra forward and backward before this step (Sophia's Hessian
        estimate; llm/optim/gradient_pass.py): its own loss on the step's micro-batches,
        reduced over ranks like the data loss, then handed to it instead of a step."""
        seed = self.cfg.train.seed * 1_000_003 + step
        for i, (x, y, docs) in enumerate(batches):
            with self.strategy.micro_batch(sync=i == len(batches) - 1):
                self.tracker.phase("forward")
                logits = self._logits(x, docs)
                loss = extra.loss(logits, y, x, seed)
                self.tracker.phase("backward")
                scaled = loss * scale
                self.tracker.watch_backward(scaled)
                self.strategy.backward(scaled)
        self.strategy.take_gradient_pass(extra, tokens)
        self.strategy.zero_grad()

    def _read_pending(self, timer: StepTimer) -> tuple[bool, dict | None]:
        """Read every step since the last read in one host sync (their losses, the last
        step's MoE losses and every rank's peaks of the last step, all-reduced in one
        collective), account for them and run the monitor on each. Every rank calls this at
        the same steps. Returns (any rank asked to stop, the last step's metrics)."""
        pending, self._pending = self._pending, []
        if not pending:
            return False, None
        world = global_world_size()
        moe_losses = self.moe.logged_losses()
        own = [_on_device(v, self.device) for v in [p.loss_sum for p in pending] + moe_losses]
        peaks = own_rows(
            self.tracker.last_step, self.tracker.last_cuda_peak, global_rank(), world, self.device
        )
        summed = torch.cat([torch.stack(own), peaks])
        if dist.is_initialized():
            dist.all_reduce(summed)
        n, m = len(pending), len(moe_losses)
        losses = summed[:n] / self.loss_copies
        if moe_losses:  # each dp rank's mean over its rows, held by its batch's every reader
            self.moe.take_global(summed[n : n + m] / (self.dp_size * self.batch_copies))
        self._rank_peaks = read_rows(summed[n + m :].tolist(), world)
        rows = [
            torch.stack(
                [
                    p.tokens,
                    p.stop_votes,
                    _on_device(p.result.grad_norm, self.device),
                    _on_device(p.result.skipped, self.device),
                ]
            )
            for p in pending
        ]
        values = torch.cat([losses.unsqueeze(1), torch.stack(rows)], dim=1).tolist()
        timings = timer.collect()
        stop, metrics = False, None
        for p, (loss_sum, tokens, votes, grad_norm, skipped), timing in zip(
            pending, values, timings, strict=True
        ):
            skipped = skipped > 0
            if isinstance(p.result.skipped, torch.Tensor):  # decided on the device
                settle_skip(self.strategy.scaler, skipped, p.step)
            self.state.skipped_steps += skipped
            loss = loss_sum / max(tokens, 1.0)
            self.state.tokens_seen += int(tokens)
            self.state.last_loss = loss
            if p.probe:
                self.state.probe_steps += 1
            else:
                self.state.timed.add(p.step, tokens, timing)
            stop = stop or votes > 0
            metrics = {
                "loss": loss,
                "grad_norm": grad_norm,
                "loss_scale": p.result.loss_scale,
                "skipped": skipped,
            }
            for alert in self.monitor.check(p.step, metrics):
                self.logger.alert(alert)
        return stop, metrics

    @torch.no_grad()
    def evaluate(self, stop: StopRequested | None = None) -> float | None:
        """The validation loss over the whole fixed set; None when a stop signal reached
        any rank first (``stop``: read between batches, llm.train.stop_vote)."""
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        schedule = self.strategy.schedule
        vote = StopVote(self.device)
        for batch in self.val_loader:
            if stop is not None and vote.of_batch(stop.requested):
                self.model.train()
                return None
            batch = self._batch_to(batch, lambda t: t.to(self.device))
            x, y, docs = batch
            with self.strategy.loss_context(training=False):
                if schedule is not None:
                    loss_sum += schedule.evaluate(batch, _cross_entropy_sum, self._forward_context)
                else:
                    loss_sum += self._loss_sum(x, y, docs)
            tokens += (y != IGNORE).sum()
        self.model.train()
        loss_sum, tokens = _all_reduce_sum([loss_sum, tokens], self.device).tolist()
        return (loss_sum / self.loss_copies) / max(tokens / self.batch_copies, 1.0)

    # ---- the loop ---------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to train.stop_at_step or train.max_steps (or a stop signal); a
        TrainingError after a resume also names the checkpoint resumed from, which may hold
        its cause (a diverged state saved as if it were healthy)."""
        self.logger.start_at(self.state.step)
        try:
            return self._fit()
        except TrainingError as exc:
            if self.resumed_from is None:
                raise
            raise TrainingError(
                f"{exc}; this run resumed from {self.resumed_from}, which may hold the cause: "
                "resume from an earlier checkpoint (checkpoint.resume=PATH) or start fresh "
                "(checkpoint.resume=none)"
            ) from exc
        finally:
            # The loader's read-ahead thread stops however the run ends: done, stopped or failed.
            self.train_loader.close()

    def _fit(self) -> dict:
        t = self.cfg.train
        timer = StepTimer(self.device)
        last = t.stop_at_step or t.max_steps
        if note := warmup_note(self.cfg.scheduler, t.max_steps):
            self.logger.info(note)
        if t.compile and t.memory_tracking != "off":
            # The tracker's dispatch mode makes Dynamo fall back to eager for those steps.
            self.logger.info(
                f"train.compile=true: probe steps (train.memory_tracking={t.memory_tracking}) "
                "run eagerly; they are never timed, and the timed steps run compiled"
            )
        self.model.train()
        with stop_guard() if self.stop is None else nullcontext(self.stop) as stop:
            # A signal during start-up: stop before the first step (the checkpoint resumed
            # from, if any, is still the newest; no step has completed since).
            if self._any_rank_stopping(stop):
                return self._stopped(stop, save=False)
            vote = StopVote(self.device)
            while self.state.step < last:
                with timer.step():
                    self._pending.append(self.train_step(timer, stop))
                self.state.step += 1
                self._account(self._pending[-1])
                # Read at every step boundary, without waiting for the device
                # (llm/train/stop_vote.py); a stop reads, logs and saves this step.
                stop_now = vote.seen(self._pending[-1].stop_votes, stop.requested)
                every = self.cfg.checkpoint.every
                saves = every and self.state.step % every == 0 and self.state.step < t.max_steps
                logs = self.probes.logs(self.state.step) or stop_now
                # A checkpoint carries tokens_seen: read the steps before saving one.
                if logs or saves:
                    voted, metrics = self._read_pending(timer)
                    stop_now = stop_now or voted
                self.logger.advance(self.state.step, self.state.last_loss, self._last_tps())
                if logs:
                    self.logger.log(self.state.step, self._log_metrics(metrics))
                if stop_now:
                    return self._stopped(stop, save=True)
                evals = self.state.step % t.eval_every == 0 and self.state.step < t.max_steps
                if evals and not self._eval_and_log(stop):
                    return self._stopped(stop, save=True)
                if saves:
                    self.save()
            # A signal during the last steps or their reading: save without the evaluation.
            if self._any_rank_stopping(stop):
                return self._stopped(stop, save=True)
            # A signal during the final evaluation ends it early (no val loss for this
            # step); during the save, that save is the newest checkpoint.
            self._eval_and_log(stop)
            self.save()
            if self._any_rank_stopping(stop):
                self.stop_signal = stop.signal
            return self.summary(stopped=self.state.step < t.max_steps)

    def _any_rank_stopping(self, stop: StopRequested) -> bool:
        """Whether a stop signal reached any rank; every rank calls this at the same point."""
        return bool(_all_reduce_sum([float(stop.requested)], self.device)[0].item())

    def _stopped(self, stop: StopRequested, save: bool) -> dict:
        self.stop_signal = stop.signal
        if save:
            self.logger.info(f"stop requested: checkpointing at step {self.state.step}")
            self.save()
        return self.summary(stopped=True)

    def _mfu(self, tokens_per_sec: float | None) -> dict[str, float | None]:
        """MFU under each FLOP count (``mfu``: 6N + 12LTd, ``mfu_causal``: what a causal
        kernel computes); None on CPU and unknown GPUs."""
        if tokens_per_sec is None:
            return dict.fromkeys(self.flops_per_token)
        # Per GPU: each rank does 1/world of the step's work.
        per_rank = tokens_per_sec / self.strategy.dims.world_size
        return {
            name: mfu(per_rank, flops, self.peak_flops)
            for name, flops in self.flops_per_token.items()
        }

    def _eval_and_log(self, stop: StopRequested | None = None) -> bool:
        """Evaluate and log; False when a stop signal ended the evaluation early."""
        val_loss = self.evaluate(stop)
        if val_loss is None:
            return False
        self.state.last_val_loss = val_loss
        self.logger.log(
            self.state.step,
            {"val_loss": val_loss, "val_ppl": perplexity(val_loss)},
        )
        return True

    def _last_tps(self) -> float | None:
        return self.state.timed.last_tokens_per_sec()

    def _account(self, step: _UnreadStep) -> None:
        """What a step leaves on the host: bytes sent (whether it was skipped is read with
        its other values, ``_read_pending``). Bytes are counted on probe steps
        (parallelism.count_comm): a timed step counts nothing, and the counters are drained
        every step so that each probe holds its own step's bytes."""
        sent = self.strategy.take_sent() | self.moe.take_sent()
        if step.probe:
            for kind, n in sent.items():
                self.state.comm_per_step[kind] = self.state.comm_per_step.get(kind, 0) + n
            self.state.comm_steps += 1

    def _log_metrics(self, metrics: dict) -> dict:
        """The logged step's metrics; timings from the timed steps since the last line,
        memory (tracked peak, activations, model state) only on a probe step's line."""
        out = dict(metrics)
        out["skipped_steps"] = self.state.skipped_steps
        out["lr"] = self.scheduler.get_last_lr()[0]
        window = self.state.timed.window()
        out.update(window)
        out.update(self._mfu(window["tokens_per_sec"]))
        out["tokens_seen"] = self.state.tokens_seen
        out["probe"] = self.probes.probes(self.state.step)
        out.update(self._step_memory())
        out.update(self.moe.metrics())
        if out["probe"]:
            out.update(self.activations)
            for kind, value in self.model_state_bytes.items():
                out[f"memory/{kind}_bytes"] = value
        return out

    def _step_memory(self) -> dict:
        """This step's peaks from every rank (read with its losses, ``_read_pending``): the
        tracker's (when it tracked the step) and on CUDA the allocator's; peak_memory_bytes
        is the highest, the allocator's on CUDA."""
        ranks = self._rank_peaks
        out = {}
        if all(peak is not None for peak, _ in ranks):
            out["memory_peak"] = [peak for peak, _ in ranks]
        if self.device.type == "cuda":
            out["cuda_max_allocated_bytes"] = [cuda for _, cuda in ranks]
            out["peak_memory_bytes"] = max(cuda for _, cuda in ranks)
        elif "memory_peak" in out:
            out["peak_memory_bytes"] = max(peak["total"] for peak in out["memory_peak"])
        return out

    def summary(self, stopped: bool) -> dict:
        """The end-of-run report (llm/train/end_report.py)."""
        return run_summary(
            self.state,
            stopped=stopped,
            stop_signal=self.stop_signal,
            mfu=self._mfu(self.state.timed.median_tokens_per_sec()),
            memory=memory_summary(self.tracker, self.device),
            activations=self.activations,
            model_state_bytes=self.model_state_bytes,
            comm=comm_summary(
                self.state, self.cfg.parallelism.count_comm, self.strategy.dims.world_size
            ),
            fp8=self.fp8.summary(),
        )
