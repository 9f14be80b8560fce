"""A small real trainer for the callback tests: a LightningModule and a DataModule that honour
the step-output contract (``ppo/step_output.py``) without any engine.

Rollouts are real ``Episode``s of real questions driven by scripted assistant turns (encoded
with the tiny tokenizer, ChatML stop token, tool responses from ``ChatFormat``), scored and
assembled by ``atlas_lightning.rollout.batch.assemble_batch``. The module computes real values
(an embedding critic), GAE returns and advantages (``algorithms.ppo``) and steps a real optimizer;
it reports a non-finite step where told to, skipping its optimizer step as ``PPOModule`` does.
``sharded_module`` is that module with a frozen base, sharded by FSDP2 (``TrainableStateStrategy``),
saving what ``PPOModule`` saves; ``slow_disk`` makes a module's checkpoint writes slow.
``FolderCheckpoint`` stands in for the checkpoint callback: a ``lightning.Checkpoint`` that writes
``global_step_N/{actor,critic}/lora_adapter/`` folders every ``save_every`` steps (and, unlike
the real one, does not itself skip non-finite steps: the guard must be what protects them).

Loaded by ``conftest.py`` (fixture ``h``) and by ``ddp_worker.py``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Optional

import lightning as L
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, IterableDataset

from atlas_lightning.algorithms.ppo import compute_gae_advantage_return
from atlas_lightning.callbacks.base import RLCallback
from atlas_lightning.store.checkpoints import write_marker
from atlas_lightning.config import compose, run_dirs
from atlas_lightning.store.lora_shapes import lora_shapes_or_config
from atlas_lightning.questions.schema import Candidate, Question
from atlas_lightning.reward import CostReward
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.rollout.agent_loop import LoopStats, Trajectory
from atlas_lightning.questions.uid import trajectory_uid
from atlas_lightning.rollout.batch import RolloutBatch, assemble_batch, session_id
from atlas_lightning.rollout.chat import ChatFormat

# ----------------------------------------------------------------------------- data


def make_chat() -> ChatFormat:
    from atlas_lightning.demo.tiny_tokenizer import to_transformers, train_tokenizer

    return ChatFormat(to_transformers(train_tokenizer(0), 4096))


def question(qid, benchmark, costs, correct, ground_truth, subset, answers=None) -> Question:
    if answers is None:
        answers = ["ABCD"[i % 4] if benchmark == "gpqa" else f"def solve():\n    return {i}\n" for i in range(len(costs))]
    candidates = tuple(Candidate(answer=a, approach=f"approach {i}", confidence=0.6, cost_usd=c, is_correct=ok,
                                 solver_model=f"solver-{i}")
                       for i, (a, c, ok) in enumerate(zip(answers, costs, correct)))
    problem = ("Which is it?\n(A) 1 (B) 2 (C) 3 (D) 4" if benchmark == "gpqa" else "Write solve() returning 1.")
    return Question(question_id=qid, benchmark=benchmark, problem=f"{qid}: {problem}", ground_truth=ground_truth,
                    candidates=candidates, data_source=f"{benchmark}_test", subsets={"subset": subset},
                    permutations=(tuple(range(len(costs))),))


TRAIN_QUESTIONS = [
    question("gt1", "gpqa", (0.12, 0.5, 0.03), (False, True, False), "B", "physics"),
    question("gt2", "gpqa", (0.2, 0.1), (True, False), "A", "chemistry"),
    question("lt1", "lcb", (0.3, 0.6), (False, True), "solve", "easy"),
]

#: Validation questions, each with the one script its greedy rollout follows (hand-computed
#: expectations in test_cb_validation.py).
VAL_SCRIPTS = {
    "gv1": ["E", "S:A"],        # reveals 0.2 (correct A): acc 1, $0.2, 1 explore
    "gv2": ["S:C"],             # wrong (B): acc 0, $0, 0 explores
    "gv3": ["E", "E", "S:D"],   # reveals 0.5 and 1.0: acc 1, $1.5, 2 explores
    "lv1": ["E", "E", "S:#2"],  # reveals 0.3, 0.6 (the 2nd correct): acc 1, $0.9, 2 explores
    "lv2": ["N"],               # no tool call: acc 0, $0, 0 explores
}
VAL_QUESTIONS = [
    question("gv1", "gpqa", (0.2, 0.4), (True, False), "A", "physics"),
    question("gv2", "gpqa", (0.3,), (False,), "B", "physics"),
    question("gv3", "gpqa", (0.5, 1.0), (False, True), "D", "chemistry"),
    question("lv1", "lcb", (0.3, 0.6), (False, True), "solve", "easy"),
    question("lv2", "lcb", (0.4,), (True,), "solve", "hard"),
]

#: Training scripts, chosen by (step + question + sample): every terminal reason but the external ones.
TRAIN_SCRIPTS = [["E", "S:B"], ["S:A"], ["E", "E", "S:#1"], ["N"], ["M"], ["E"] * 3]


def turn_text(token: str, benchmark: str) -> str:
    if token == "E":
        return 'Let me look.\n<tool_call>\n{"name": "explore"}\n</tool_call>'
    if token.startswith("S:"):
        answer = token[2:]
        if benchmark == "lcb" and not answer.startswith("#"):
            answer = "#1"
        if benchmark == "gpqa" and answer.startswith("#"):
            answer = "B"
        return f'<tool_call>\n{{"name": "submit", "arguments": {{"answer": "{answer}"}}}}\n</tool_call>'
    if token == "N":
        return "I think the answer is B, no tools needed."
    if token == "M":
        return '<tool_call>\n{"name": "explore", \n</tool_call>'
    raise ValueError(token)


def run_script(chat: ChatFormat, q: Question, sample: int, script: list[str], max_turns: int = 3) -> Trajectory:
    """One episode driven by ``script`` turns to its end (``max_turns`` ends an all-explore one)."""
    tok = chat.tokenizer
    episode = Episode(q, sample, RuntimeConfig(max_explores=8, max_turns=max_turns), seed=0)
    prompt = chat.prompt_ids(episode.messages(), episode.tools())
    episode.on_prompt_tokens(len(prompt))
    traj = Trajectory(uid=trajectory_uid(q.benchmark, q.question_id), session_id=session_id(sample),
                      episode=episode, prompt_ids=prompt)
    for turn, token in enumerate(script):
        ids = tok.encode(turn_text(token, q.benchmark), add_special_tokens=False) + [chat.stop_token_ids[0]]
        start = len(traj.response_ids)
        traj.response_ids += ids
        traj.response_mask += [1] * len(ids)
        traj.response_logprobs += [-0.05 * (1 + (i + turn) % 7) for i in range(len(ids))]
        reply = episode.on_assistant_turn(chat.decode_turn(ids), start, len(traj.response_ids))
        if reply is None or episode.done:
            break
        tool = chat.tool_response_ids(reply, turn_closed=True)
        end = len(traj.response_ids)
        traj.response_ids += tool
        traj.response_mask += [0] * len(tool)
        traj.response_logprobs += [0.0] * len(tool)
        episode.on_tool_response_tokens(end, end + len(tool))
    assert episode.done, f"script {script} did not end {q.question_id}"
    return traj


def rank_share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


# ----------------------------------------------------------------------------- the datamodule


class _Steps(IterableDataset):
    def __init__(self, dm: "ScriptedDataModule") -> None:
        self.dm = dm

    def __len__(self) -> int:
        return self.dm.total_steps

    def __iter__(self):
        while self.dm.next_step <= self.dm.total_steps:
            step = self.dm.next_step
            batch = self.dm.rollout(step)
            self.dm.next_step = step + 1
            yield batch


def _identity(batch):
    return batch


class ScriptedDataModule(L.LightningDataModule):
    """``RolloutDataModule``'s contract (``rollout``, ``validation_rollout``, ``chat``,
    ``train_questions``, ``val_questions``, ``next_step``) on scripted episodes. Validation draws
    from the global RNGs on purpose (as an engine might): the callback must isolate training."""

    def __init__(self, cfg, chat: ChatFormat, samples: int = 2) -> None:
        super().__init__()
        self.cfg, self.chat, self.samples = cfg, chat, samples
        self.total_steps = int(cfg.trainer.total_steps)
        self.next_step = 1
        self.train_questions = list(TRAIN_QUESTIONS)
        self.val_questions = list(VAL_QUESTIONS)
        self.val_calls: list[int] = []
        self.weights_version = 0
        #: the validation to ride with the next training rollout, and those that rode (by step)
        self.rider: Optional[int] = None
        self.ridden: dict[int, RolloutBatch] = {}
        #: a step whose rollout signals ``hold_signal`` and sleeps ``hold_s`` first (to be killed there)
        self.hold_step: Optional[int] = None
        self.hold_signal: Optional[Path] = None
        self.hold_s = 600.0

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _batch(self, trajectories, step, partition) -> RolloutBatch:
        return assemble_batch(trajectories, step=step, partition=partition, run_id=self.cfg.name,
                              scorer=CostReward(cost_per_usd=self.cfg.reward.cost_per_usd, no_submit_reward=0.0),
                              stats=LoopStats(trajectories=len(trajectories)), weights_version=self.weights_version)

    # ``RolloutDataModule``'s riding validation: the scripted validation sampled with the rollout
    carries_validation = True

    def carry_validation(self, step: int) -> None:
        self.rider = step

    def take_validation(self, step: int) -> Optional[RolloutBatch]:
        if self.rider == step:
            self.rider = None
        return self.ridden.pop(step, None)

    def rollout(self, step: int) -> RolloutBatch:
        if step == self.hold_step:
            self.hold_signal.touch()
            time.sleep(self.hold_s)
        if self.rider is not None:
            from atlas_lightning.rollout.rng import preserved_rng

            with preserved_rng():
                batch = self.ridden[self.rider] = self.validation_rollout(self.rider)
            batch.timing.update({"gen": 0.002, "tail": 0.001, "overlapped": 0.001})
            self.rider = None
        rank, world = self._rank()
        trajectories = []
        for qi, q in enumerate(rank_share(self.train_questions, rank, world)):
            for sample in range(self.samples):
                script = TRAIN_SCRIPTS[(step + qi + sample + rank) % len(TRAIN_SCRIPTS)]
                trajectories.append(run_script(self.chat, q, sample, script))
        return self._batch(trajectories, step, "train")

    def validation_rollout(self, step: int) -> RolloutBatch:
        random.random(), np.random.rand(), torch.rand(3)  # an engine touching the global RNGs
        self.val_calls.append(step)
        rank, world = self._rank()
        trajectories = [run_script(self.chat, q, 0, VAL_SCRIPTS[q.question_id])
                        for q in rank_share(self.val_questions, rank, world)]
        return self._batch(trajectories, step, "val")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Steps(self), batch_size=None, num_workers=0, collate_fn=_identity)

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])


# ----------------------------------------------------------------------------- the module

TENSOR_NAMES = ("values", "returns", "advantages", "old_log_probs", "token_rewards")


class ScriptedModule(L.LightningModule):
    """A PPOModule stand-in that honours the step-output contract. ``nan_at``: RL steps whose
    ``actor/entropy`` turns NaN for the first trajectory (no optimizer step is then taken)."""

    def __init__(self, cfg, nan_at=(), vocab: int = 2048) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.critic = torch.nn.Embedding(vocab, 1)
        torch.nn.init.normal_(self.critic.weight, std=0.1)
        self.nan_at = set(nan_at)
        self.rl_step = 0
        self.logged: list[tuple[int, dict]] = []
        self.draws: list[tuple] = []
        self.outputs: dict[int, dict] = {}
        self.restored: list[Path] = []
        #: ``(version, log_step)`` of every ``sync_weights`` call (the NaN guard's rollback asks for one).
        self.synced: list[tuple[int, Optional[int]]] = []
        self.optimizer_steps = 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> dict:
        self.rl_step = batch.step
        self.draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
        mask = batch.padded("response_mask")
        values = self.critic(batch.padded("response_ids", torch.long)).squeeze(-1) * mask
        rewards = batch.padded("token_rewards")
        advantages, returns = compute_gae_advantage_return(rewards, values.detach(), mask, 1.0, 1.0)
        loss = (((values - returns) ** 2) * mask).sum() / mask.sum()
        finite = batch.step not in self.nan_at
        if finite:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            self.optimizer_steps += 1
        lengths = [len(r.response_ids) for r in batch.records]
        padded = {"values": values.detach(), "returns": returns, "advantages": advantages,
                  "old_log_probs": batch.padded("response_logprobs"), "token_rewards": rewards}
        tensors = {name: [padded[name][i, :n].numpy().astype(np.float32).copy() for i, n in enumerate(lengths)]
                   for name in TENSOR_NAMES}
        metrics = dict(batch.metrics())
        metrics["critic/vf_loss"] = float(loss.detach())
        metrics["actor/entropy"] = 0.7
        output = {"step": batch.step, "batch": batch, "tensors": tensors, "metrics": metrics, "finite": finite}
        if not finite:
            first = batch.records[0]
            metrics["actor/entropy"] = float("nan")
            output["nonfinite"] = {"what": ["actor/entropy"], "phase": "update_actor",
                                   "where": {"actor/entropy": {"count": 3,
                                                               "trajectories": [f"{first.uid}/{first.session_id}"]}},
                                   "optimizer_steps_applied": {"critic": 0, "actor": 0}}
        self.outputs[batch.step] = output
        return output

    def log_metrics(self, metrics: dict, step: int) -> None:
        if self.trainer.is_global_zero:
            self.logged.append((step, dict(metrics)))

    def snapshot_adapters(self, into=None):
        """A host copy of the weights now (in ``into``'s reused buffer when given, as
        ``PPOModule.snapshot_adapters``), and its writer for later (rank 0 writes)."""
        weight, writes = host_copy(self.critic.weight.detach(), into), self.trainer.is_global_zero
        return lambda step_dir: write_adapters(Path(step_dir), weight) if writes else None

    def sync_weights(self, version: int, log_step: Optional[int] = None) -> dict:
        """Records the call (there is no engine here), as ``PPOModule.sync_weights`` is asked."""
        self.synced.append((version, log_step))
        return {}

    def restore_checkpoint(self, step_dir) -> None:
        step_dir = Path(step_dir)
        state = load_file(str(step_dir / "critic" / "lora_adapter" / "adapter_model.safetensors"))
        self.critic.weight.data.copy_(state["weight"])
        self.restored.append(step_dir)


def sharded_module(cfg, resume_from=None):
    from atlas_lightning.ppo.module import PPOModule, weight_sync_of

    class Sharded(ScriptedModule):
        """The scripted module with a frozen base beside its trainable tensors, sharded, and
        PPOModule's own checkpoint contents: trainable tensors only (the base comes from
        ``model.path``), Adam's states, the RL step, the weight sync's state; and PPOModule's
        starting sync (``on_fit_start``, ``on_train_start``), recorded with the weights it saw."""

        _trainable_keys = PPOModule._trainable_keys
        on_save_checkpoint = PPOModule.on_save_checkpoint
        on_load_checkpoint = PPOModule.on_load_checkpoint
        on_fit_start = PPOModule.on_fit_start
        on_train_start = PPOModule.on_train_start
        _restored_after_fit_start = PPOModule._restored_after_fit_start

        def __init__(self, cfg):
            super().__init__(cfg)
            self.base = torch.nn.Linear(8, 8)
            self.base.requires_grad_(False)
            self.strict_loading = False
            self.skipped_optimizer_steps = {"actor": 0, "critic": 0}
            self.resume_from = resume_from
            self.weight_sync = weight_sync_of(cfg)
            self._rng_to_restore = None
            self.served: list[tuple[int, torch.Tensor]] = []

        def sync_weights(self, version, log_step=None):
            self.weight_sync.sync_id += 1  # as a real sync counts it
            self.served.append((version, self.critic.weight.full_tensor().detach().clone()))
            return super().sync_weights(version, log_step)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.critic.parameters(), lr=0.05)

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            if not hasattr(self.critic.weight, "full_tensor"):
                fully_shard(self.base, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.critic, mesh=self.device_mesh["data_parallel"])

        def snapshot_adapters(self, into=None):
            full = host_copy(self.critic.weight.full_tensor().detach(), into)  # collective: every rank
            writes = self.trainer.is_global_zero
            return lambda step_dir: write_adapters(step_dir, full) if writes else None

    return Sharded(cfg)


def slow_disk(module, from_step: int, seconds: float, signals: Optional[Path] = None):
    """``module`` whose checkpoint adapter writes, from RL step ``from_step`` on, first touch
    ``signals/writing_<step>`` (when given) and sleep ``seconds`` (a slow disk; the write that
    follows is the real one)."""
    snapshot = module.snapshot_adapters

    def slow_snapshot(into=None):
        write, step = snapshot(into=into), module.rl_step

        def slow_write(step_dir) -> None:
            if step >= from_step and module.trainer.is_global_zero:
                if signals is not None:
                    (signals / f"writing_{step}").touch()
                time.sleep(seconds)
            write(step_dir)

        return slow_write

    module.snapshot_adapters = slow_snapshot
    return module


def host_copy(weight: torch.Tensor, into=None) -> torch.Tensor:
    """``weight`` copied to the host: into ``into``'s buffer (``HostBuffers``, reused from one
    save to the next) when given, as ``PPOModule.snapshot_adapters`` copies, else a new tensor."""
    if into is None:
        return weight.clone()
    copied = into.copy("critic.weight", weight)
    into.synchronize()
    return copied


def write_adapters(folder: Path, weight: torch.Tensor) -> None:
    for name in ("actor", "critic"):
        adapter = folder / name / "lora_adapter"
        adapter.mkdir(parents=True, exist_ok=True)
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
        save_file({"weight": weight.detach().clone()}, str(adapter / "adapter_model.safetensors"))


class FolderCheckpoint(L.pytorch.callbacks.Checkpoint):
    """Writes ``global_step_N/{actor,critic}/lora_adapter/`` every ``save_every`` steps (rank 0),
    then the completion marker of ``callbacks/checkpoint.py`` (``checkpoint.json``)."""

    def __init__(self, save_every: int) -> None:
        self.save_every = save_every
        self.saved: list[int] = []
        #: step -> {relative path: bytes} of the folder as written, to prove it stays intact.
        self.snapshots: dict[int, dict[str, bytes]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = outputs["step"]
        if step % self.save_every or not trainer.is_global_zero:
            return
        folder = run_dirs(pl_module.cfg)["checkpoints"] / f"global_step_{step}"
        write_adapters(folder, pl_module.critic.weight)
        (folder / "lightning").mkdir(exist_ok=True)
        torch.save({"critic": pl_module.critic.weight.detach().clone()}, folder / "lightning" / "state.ckpt")
        write_marker(folder, step)
        self.saved.append(step)
        self.snapshots[step] = snapshot(folder)


class RestoreListener(RLCallback):
    """Records ``on_rl_weights_restored`` calls (a user's callback hearing of a rollback)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Path]] = []

    def on_rl_weights_restored(self, trainer, pl_module, step, checkpoint) -> None:
        self.calls.append((step, Path(checkpoint)))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- running


def make_cfg(root: Path, name: str = "cbtest", total_steps: int = 4, extra: Optional[list[str]] = None):
    # lambda 0.1 and one validation sample a question: the hand-computed expectations assume them
    return compose(["experiment=tiny-cpu", f"paths.root={root}", f"name={name}", "reward.cost_per_usd=0.1",
                    "rollout.val_n=1", f"trainer.total_steps={total_steps}", *(extra or [])])


def callback(cfg, name: str, **overrides):
    """The run's callback ``name`` built from its entry in ``cfg.callbacks`` (``conf/callbacks/``:
    its folders and settings interpolated there), with ``overrides``. The artifacts callback also
    gets the run's record, as ``run.wiring.build_callbacks`` gives it: the resolved config and the
    LoRA shapes (the config's where a starting folder cannot be read, as here)."""
    if name == "artifacts":
        record = {"config": OmegaConf.to_container(cfg, resolve=True), "lora": lora_shapes_or_config(cfg)[0]}
        overrides = {**record, **overrides}
    return instantiate(cfg.callbacks[name], _partial_=True)(**overrides)


def make_trainer(callbacks: list, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    if not any(isinstance(c, L.pytorch.callbacks.Checkpoint) for c in callbacks):
        options["enable_checkpointing"] = False
    options.update(kwargs)
    return L.Trainer(**options)


def fit(cfg, chat, callbacks, nan_at=(), **trainer_kwargs):
    """``(trainer, module, datamodule)`` after ``trainer.fit`` (exceptions propagate)."""
    module = ScriptedModule(cfg, nan_at=nan_at)
    datamodule = ScriptedDataModule(cfg, chat)
    trainer = make_trainer(callbacks, **trainer_kwargs)
    trainer.fit(module, datamodule=datamodule)
    return trainer, module, datamodule
