"""A tiny Llama trained to copy, for tests of lossy KV: its greedy tokens come from the KV
cache through attention, with confident margins.

The engine tests' seeded random Llama (``engine_support.make_model``) is chaotic and
flat (top-1 logprob about -2.7, margins of 0.2-0.8): KV noise of relative MSE 1e-4
already changes its greedy tokens, so no lossy codec can keep them. This model has the
same shape and config (``TINY_LLAMA``) but does one thing well: induction. After a
random token sequence has been seen, it continues its repetition (``induction_prompts``).
Layer 0 attends to the previous token and writes its code into the residual; layer 1
matches the current token against those codes in the keys (the low-frequency RoPE pairs,
which hardly rotate over a few hundred tokens) and copies the value of the token that
followed.

Recipe: from scratch, this circuit does not form within a CPU minute (500 AdamW steps
stay at the uniform loss, ln 997, even with the attention patterns supervised), so the
weights start from the circuit written in directly, under seeded Gaussian noise (std
0.02, as an initializer would) that breaks it (1 token of 96 copied; without the noise
it copies all), and are then trained end to end on the copy task (cross-entropy on the
predictable repeated tokens): every weight dense, shaped by gradient descent. Token
ids 0-2 (bos 1, eos 2) never occur in the training data, so the model never produces
them. 400 steps take about 60 s on 2 cores (up to 100 s when another process shares
them); the weights are bit-identical from run to run on one machine (with 1 or 2
threads alike; another CPU or torch may round differently).

Measured in vLLM (bf16) on held-out prompts of ``induction_prompts`` (250 tokens), 16
greedy tokens each: every token is the copy; the chosen token leads the second best by
5.2 nats or more (median 9.5), where the random model leads by 0.2-0.8; vLLM's tokens
equal transformers' in float32 and its margins differ by 0.12 at most. Prompts of
106-394 tokens (periods 16-64) copy as well; at 490 tokens too, by a thinner least margin
(2.8). Gaussian noise on the prompt's K and V (transformers, float32) of relative MSE
0.009, a 4-bit codec's, changes no token and moves a margin by 0.9 at most; 0.1 changes
none (3.7 at most); 0.3 changes five prompts of six.

Owns: the recipe, its training and the cached model directory.
Must not: depend on vLLM (the tests run the model in vLLM through ``engine_child.py``).

Usage: ``python tests/engine/trained_model.py DIR`` writes (or reuses) the model in ``DIR``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    from .engine_support import TINY_LLAMA
except ImportError:  # run as a script
    from engine_support import TINY_LLAMA

if TYPE_CHECKING:
    import torch

RECIPE: dict[str, Any] = {
    "seed": 0, "init_noise_std": 0.02,
    "previous_token_gap": 25.0,  # layer 0: score of the previous token over the next best
    "match_score": 40.0,  # layer 1: score of a matching key (non-matches: 0 on average)
    "target_logit": 20.0,  # logit of the copied token (others: 0 on average)
    "steps": 400, "batch": 8, "seq_tokens": 384, "min_period": 16, "max_period": 64,
    "lr": 1e-3, "warmup_steps": 20,
}
"""Everything the weights depend on; with the source of this file it names the cached model."""

MARKER = "trained-recipe.json"
THREADS = 2  # torch threads while training; with 1 the weights come out the same, slower
FIRST_TOKEN = 3  # 0 (pad), 1 (bos) and 2 (eos) never occur in the data
HEAD_DIM = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]  # 32: RoPE pairs (i, i + 16)
ROPE_THETA = 10000.0  # Llama's default; TINY_LLAMA does not set it
CODE = slice(0, 48)  # residual dims: the token's code (three blocks of 16, each of norm 1/sqrt(3))
PREVIOUS = slice(48, 80)  # the previous token's code[0:32], written by layer 0
COPIED = slice(80, 127)  # the copied token's code[0:47], written by layer 1; read by lm_head
CONSTANT = 127  # 1 in every embedding: layer 0's queries and keys (position only)


def make_trained_model(directory: Path) -> Path:
    """Write the trained model (``config.json``, ``model.safetensors`` in bf16, and the
    recipe marker) to ``directory``, or reuse the one there if its marker matches this
    recipe and source; ``directory``. Training runs in a child process with
    ``OMP_WAIT_POLICY=PASSIVE``: with busy-waiting threads it took 2-5 times longer
    whenever another process used one of the 2 cores."""
    if not _cached(directory, _marker()):
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        subprocess.run([sys.executable, __file__, "--in-process", str(directory)], env=env, check=True)
    return directory


def induction_prompts(n: int, seed: int, period: int = 40, repeats: int = 6, tail: int = 10) -> list[list[int]]:
    """``n`` prompts, each a random sequence of ``period`` distinct token ids (>= 3)
    repeated ``repeats`` times, then its first ``tail`` tokens; the trained model's greedy
    continuation is the sequence's token ``tail``, ``tail + 1``, ... (``copy_target``)."""
    import random

    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        sequence = rng.sample(range(FIRST_TOKEN, TINY_LLAMA["vocab_size"]), period)
        prompts.append(sequence * repeats + sequence[:tail])
    return prompts


def copy_target(prompt: list[int], num_tokens: int, period: int = 40) -> list[int]:
    """The ``num_tokens`` tokens that continue the repetition in ``prompt``."""
    return [prompt[(len(prompt) + i) % period] for i in range(num_tokens)]


def _marker() -> dict[str, Any]:
    return {"recipe": RECIPE, "source_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}


def _train_and_write(directory: Path) -> None:
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    model, final_loss = _train(_circuit())
    marker = _marker() | {"train_s": round(time.perf_counter() - t0, 1), "final_loss": final_loss,
                          "torch": torch.__version__}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).unlink(missing_ok=True)
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    _write(directory / "model.safetensors", lambda path: save_file(tensors, str(path)))
    _write(directory / "config.json", lambda path: path.write_text(json.dumps(TINY_LLAMA)))
    _write(directory / MARKER, lambda path: path.write_text(json.dumps(marker, indent=1)))  # last: marks it complete


def _cached(directory: Path, marker: dict[str, Any]) -> bool:
    try:
        found = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    same = all(found.get(key) == marker[key] for key in marker)
    return same and (directory / "model.safetensors").exists() and (directory / "config.json").exists()


def _write(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    keys = {k: v for k, v in TINY_LLAMA.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return LlamaForCausalLM(LlamaConfig(**keys, attn_implementation="sdpa")).float()


def _codes(gen: torch.Generator) -> torch.Tensor:
    """Random token codes [vocab, 48]: three blocks of 16 dims, each of norm 1/sqrt(3)."""
    import torch

    codes = torch.randn(TINY_LLAMA["vocab_size"], 48, generator=gen)
    for block in range(3):
        part = codes[:, 16 * block:16 * (block + 1)]
        part /= part.norm(dim=1, keepdim=True) * math.sqrt(3)
    return codes


def _previous_token_qk(gap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A constant query and key (one head) whose RoPE score peaks at distance 1: per pair
    ``i``, q conj(k) = A_i exp(-i theta_i), so the score is sum_i A_i cos((d - 1) theta_i).
    Half the weight on the fastest pair and half over the next nine keeps every other
    distance below 2048 at least 0.221 * sum(A) lower; ``gap`` sets that margin."""
    import torch

    theta = ROPE_THETA ** (-torch.arange(16, dtype=torch.float64) / 16)
    weights = torch.cat([torch.tensor([0.5]), torch.full((9,), 0.5 / 9), torch.zeros(6)]).double()
    weights *= gap * math.sqrt(HEAD_DIM) / 0.221  # sdpa divides scores by sqrt(head_dim)
    q, k = torch.zeros(HEAD_DIM, dtype=torch.float64), torch.zeros(HEAD_DIM, dtype=torch.float64)
    k[:16] = weights.sqrt()
    q[:16], q[16:] = weights.sqrt() * torch.cos(theta), -weights.sqrt() * torch.sin(theta)
    return q.float(), k.float()


def _circuit() -> Any:
    """The induction circuit written into a Llama of TINY_LLAMA's shape (float32), under
    seeded noise; MLPs carry only noise. Scales assume the residual norms of a clean run:
    |embedding|^2 = 2, plus 2/3 after layer 0, plus ~1 after layer 1."""
    import torch

    gen = torch.Generator().manual_seed(RECIPE["seed"])
    model = _llama()
    noise = RECIPE["init_noise_std"]
    sd = {name: torch.randn(t.shape, generator=gen) * noise for name, t in model.state_dict().items()}
    sd |= {name: torch.ones_like(t) for name, t in sd.items() if name.endswith("norm.weight")}
    hidden, hd = TINY_LLAMA["hidden_size"], HEAD_DIM
    codes = _codes(gen)
    sd["model.embed_tokens.weight"][:, CODE] += codes
    sd["model.embed_tokens.weight"][:, CONSTANT] += 1.0

    # layer 0: every head attends to the previous token and writes a quarter of its code[0:32]
    p = "model.layers.0.self_attn."
    norm0 = math.sqrt(hidden / 2)  # RMSNorm scale of an embedding
    q, k = _previous_token_qk(RECIPE["previous_token_gap"])
    for head in range(4):
        sd[p + "q_proj.weight"][head * hd:(head + 1) * hd, CONSTANT] += q / norm0
        sd[p + "o_proj.weight"][PREVIOUS, head * hd:(head + 1) * hd] += torch.eye(hd) / 4
    for kv in range(2):
        sd[p + "k_proj.weight"][kv * hd:(kv + 1) * hd, CONSTANT] += k / norm0
        sd[p + "v_proj.weight"][kv * hd:(kv + 1) * hd, 0:32] += torch.eye(hd) / norm0

    # layer 1: query = current code block kv (16 dims), key = previous token's code block kv,
    # both in the 8 slowest RoPE pairs (dims 8-15 and 24-31); value = the current code
    p = "model.layers.1.self_attn."
    norm1 = math.sqrt(hidden / (2 + 2 / 3))
    scale = math.sqrt(RECIPE["match_score"] * 3 * math.sqrt(hd))  # |block|^2 = 1/3
    slow = [*range(8, 16), *range(24, 32)]
    for head in range(4):
        kv = head // 2
        for c, d in enumerate(slow):
            sd[p + "q_proj.weight"][head * hd + d, CODE.start + 16 * kv + c] += scale / norm1
    for kv in range(2):
        for c, d in enumerate(slow):
            sd[p + "k_proj.weight"][kv * hd + d, PREVIOUS.start + 16 * kv + c] += scale / norm1
    sd[p + "v_proj.weight"][0:32, 0:32] += torch.eye(32) / norm1  # kv head 0: code[0:32]
    sd[p + "v_proj.weight"][32:48, 32:48] += torch.eye(16) / norm1  # kv head 1: code[32:48]
    copied = list(range(COPIED.start, COPIED.stop))
    for head in range(4):  # the two heads of a kv head write half each: code[0:32], then code[32:47]
        rows = copied[:32] if head < 2 else copied[32:]
        sd[p + "o_proj.weight"][rows, head * hd:head * hd + len(rows)] += torch.eye(len(rows)) / 2

    norm_out = math.sqrt(hidden / (2 + 2 / 3 + 47 / 48))
    sd["lm_head.weight"][FIRST_TOKEN:, COPIED] += codes[FIRST_TOKEN:, :47] * RECIPE["target_logit"] / norm_out
    model.load_state_dict(sd)
    return model


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch, seq_tokens], each row a random sequence of distinct tokens of a
    random period repeated; and the targets, -100 (ignored) where the next token is not
    yet predictable (the first period and the token after it)."""
    import torch

    batch, length = RECIPE["batch"], RECIPE["seq_tokens"]
    vocab = TINY_LLAMA["vocab_size"] - FIRST_TOKEN
    ids = torch.empty(batch, length, dtype=torch.long)
    targets = torch.full((batch, length - 1), -100, dtype=torch.long)
    for row in range(batch):
        period = int(torch.randint(RECIPE["min_period"], RECIPE["max_period"] + 1, (1,), generator=gen))
        sequence = torch.randperm(vocab, generator=gen)[:period] + FIRST_TOKEN
        ids[row] = sequence.repeat(length // period + 1)[:length]
        targets[row, period:] = ids[row, period + 1:]
    return ids, targets


def _train(model: Any) -> tuple[Any, float]:
    """AdamW on the copy task, linear warmup then cosine decay; the model and its mean
    loss over the last 50 steps."""
    import torch

    gen = torch.Generator().manual_seed(RECIPE["seed"] + 1)
    steps, warmup = RECIPE["steps"], RECIPE["warmup_steps"]
    opt = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses = []
    for _ in range(steps):
        ids, targets = _batch(gen)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return model.eval(), round(sum(losses[-50:]) / 50, 5)


if __name__ == "__main__":
    if sys.argv[1] == "--in-process":  # the child of make_trained_model
        _train_and_write(Path(sys.argv[2]))
    else:
        t0 = time.perf_counter()
        out = make_trained_model(Path(sys.argv[1]))
        print(f"{out} in {time.perf_counter() - t0:.1f} s: {(out / MARKER).read_text()}")
