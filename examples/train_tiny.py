"""Train mmkv's bundled tiny VLM and its draft model on synthetic scenes and documents.

    python examples/train_tiny.py --out mmkv/bundled          # the committed models (~35 min, 2 cores)
    python examples/train_tiny.py --out mmkv/bundled --draft-only   # the draft alone (~5 min)
    python examples/train_tiny.py --out /tmp/smoke --smoke    # a few steps end to end

Writes ``<out>/tiny-vlm`` (mmkv_vlm: open_clip ViT with one 32-pixel patch per grid cell of the
96-pixel scenes, projector, 8-layer Llama-family LM of width 128 with cross-attention at layers 1,
4 and 7, and early exits after layers 2 and 3 trained LayerSkip-style), ``<out>/tiny-draft`` (a
1-layer Llama on the same tokenizer), ``<out>/loss.png`` and ``<out>/training.json`` (arguments,
time, final losses, held-out accuracy). Deterministic from ``--seed``: data, initialisation and
batch order.

What makes it learn in the budget, and why (what each measured: docs/bundled-model.md):

* Each image patch is tagged with the text model's own embeddings of its cell's name ("top left"),
  scaled to the size of the patch features (``patch_name_ids`` in the config). With untagged or
  randomly tagged patches the first cross-attention layer looks at the same patches whatever cell
  the question names (``examples/inspect_cross_attention.py``), and positions stay at chance.
* A peak learning rate of 1e-3: at 3e-3 the attention locks onto the shapes before it learns where
  they are.
* Many document steps, reports short at first (``--curriculum``): looking a value up by its
  field and copying it out appears only after about two thousand document batches.
* Values written right after their field's name, in the report and in the answers
  (``population 452,031``): once the model writes the name, finding and copying the value is the
  plain copy-what-followed-this-token-before pattern. With the value a few words after its field
  ("the population of kalomer is 452,031") the model copied all but the value's first token.
* No loss on the values where the report states them (``value_spans``): nothing can predict them
  there, and learning to guess them teaches a prior that beats copying for the mayor's surname (the
  model writes one surname per first name, whatever the report says).
* The draft gets the same short-reports-first curriculum and 6000 steps: trained briefly on
  full-length reports it does not learn to copy from a report, and the target rejects most of its summary drafts.
  One layer: a second took its loss from 0.29 to 0.28 and made each draft pass and the draft's
  prompt processing dearer, which cost more than it gave back (docs/speculation.md).
* Near-miss presence questions (``near_miss_questions``): a shape of the scene as it is, with
  another colour, and as another kind, so that "yes" for a shape of the asked kind in another
  colour is wrong in training too.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mmkv.eval import evaluate
from mmkv.models import MmkvVLM
from mmkv.synthetic import (CHAT_TEMPLATE, COLOURS, POSITIONS, QA, REPORT_FILLERS, SHAPES, SIZES,
                            document_examples, document_prompt, random_report, random_scene,
                            report_questions, scene_examples, scene_prompt, scene_questions)
from vision import OpenClipEncoder

TRAIN_SEED_OFFSET = 1_000  # evaluation uses seeds below this
IMAGE_TOKEN, EOS, PAD = "<image>", "<eos>", "<pad>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS, IMAGE_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IMAGE_TOKEN], chat_template=CHAT_TEMPLATE)


def vlm_config(args, tokenizer: PreTrainedTokenizerFast) -> dict:
    return {
        "vision": {"open_clip_vision_cfg": {"image_size": 96, "layers": 1 if args.smoke else 3,
                                            "width": 96, "patch_size": 32, "head_width": 32},
                   "embed_dim": 64, "image_size": 96,
                   "patch_name_ids": [tokenizer.encode(" " + cell) for cell in POSITIONS],
                   "patch_name_scale": args.patch_name_scale},
        "text_config": {"vocab_size": len(tokenizer), "hidden_size": args.hidden,
                        "intermediate_size": args.hidden * 8 // 3,
                        "num_hidden_layers": args.layers, "cross_attention_layers": args.cross_layers,
                        "num_attention_heads": args.hidden // 32, "num_key_value_heads": args.hidden // 32,
                        "max_position_embeddings": 1024, "rope_theta": 10000.0,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                        "tie_word_embeddings": True, "initializer_range": 0.02,
                        "bos_token_id": tokenizer.eos_token_id,
                        "eos_token_id": tokenizer.eos_token_id,
                        "pad_token_id": tokenizer.pad_token_id},
        "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "question_template": scene_prompt("{question}"),
        "early_exit_layer": args.early_exit_layers[0],
    }


def encode(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """Token ids of prompt + " answer" + EOS, and where the answer starts."""
    p = tokenizer.encode(prompt)
    a = tokenizer.encode(" " + answer) + [tokenizer.eos_token_id]
    return p + a, len(p)


def batch_tensors(seqs: list[tuple[list[int], int | list[tuple[int, int]]]],
                  pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids and labels; a sequence's answer spans are its start (to the end) or a list of
    ``(start, end)`` spans."""
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, spans) in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        for a, b in ([(spans, len(s))] if isinstance(spans, int) else spans):
            labels[i, a:b] = torch.tensor(s[a:b])
    return ids, labels


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def cell_labels(scene) -> list[int]:
    """Per grid cell: 0 when empty, else 1 + (shape, colour, size) index."""
    labels = [0] * 9
    colours, sizes = list(COLOURS), list(SIZES)
    for s in scene.shapes:
        labels[s.cell] = 1 + (SHAPES.index(s.kind) * len(colours) + colours.index(s.colour)) * len(sizes) \
            + sizes.index(s.size)
    return labels


def vlm_losses(model: MmkvVLM, probe: torch.nn.Module, ids, labels, pixels, cells,
               exit_layers: list[int]):
    """Final-layer loss, early-exit losses (first k layers + shared norm and head, for each k) and
    the vision probe loss (what each patch shows, which teaches the tower to see before the LM can
    read it)."""
    lm = model.language_model
    kwargs = {}
    probe_loss = torch.zeros(())
    if pixels is not None:
        _, tokens = model.vision_tower(pixels)
        probe_loss = F.cross_entropy(probe(tokens).flatten(0, 1), cells.flatten())
        kwargs = model.image_inputs(model.project(tokens), ids.shape[1])
    out = lm.model(input_ids=ids, output_hidden_states=True, use_cache=False, **kwargs)
    final = lm.lm_head(out.last_hidden_state)
    early = [lm_loss(lm.lm_head(lm.model.norm(after_layers(model, out.hidden_states, k, bool(kwargs)))),
                     labels) for k in exit_layers]
    return lm_loss(final, labels), early, probe_loss


def after_layers(model: MmkvVLM, hidden_states: tuple, k: int, with_image: bool) -> torch.Tensor:
    """The hidden state after the first ``k`` layers. transformers records one state per layer
    that ran, and text without an image skips the cross-attention layers (the engine runs them as
    the identity), so for text the index counts only the layers that ran."""
    skipped = 0 if with_image else sum(c < k for c in model.language_model.config.cross_attention_layers)
    return hidden_states[k - skipped]


def schedule(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * (step - warmup) / max(1, total - warmup)))).item()


def scene_pairs(seed: int, n: int) -> list:
    """About ``n`` (scene, question) pairs: every question kind of each scene, and the near misses
    of ``near_miss_questions``."""
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < n:
        scene = random_scene(rng)
        pairs += [(scene, qa) for qa in scene_questions(scene, rng) + near_miss_questions(scene, rng)]
    return pairs


def near_miss_questions(scene, rng: random.Random) -> list[QA]:
    """Presence questions about one of the scene's shapes as it is, with another colour and as
    another kind: the answers hinge on colour and kind together, which a model that checks only one
    of them gets wrong."""
    shape = rng.choice(scene.shapes)
    colour = rng.choice([c for c in COLOURS if c != shape.colour])
    kind = rng.choice([k for k in SHAPES if k != shape.kind])
    questions = [f"is there a {shape.colour} {shape.kind}?", f"is there a {colour} {shape.kind}?",
                 f"is there a {shape.colour} {kind}?"]
    return [QA(q, scene.answer(q), "presence") for q in questions]


def is_scene_step(step: int, scene_fraction: float) -> bool:
    """Scene and document batches interleaved evenly in the given proportion, a scene batch first
    (0.5 alternates scene, document, scene, ...)."""
    return math.ceil((step + 1) * scene_fraction) > math.ceil(step * scene_fraction)


def report_fillers(progress: float, curriculum: float) -> tuple[int, int]:
    """Filler sentences per report at ``progress`` (0..1) of training: short reports first, so the
    lookup of a value by its field is found early, growing to the full range at ``curriculum``."""
    lo, hi = REPORT_FILLERS
    if curriculum <= 0 or progress >= curriculum:
        return lo, hi
    top = round(hi * progress / curriculum)
    return max(0, top - (hi - lo)), top


def make_batches(tokenizer, encoder: OpenClipEncoder, seed: int, steps: int, scene_bs: int, doc_bs: int,
                 scene_fraction: float, curriculum: float):
    """Scene and document batches, generated on the fly from per-step seeds."""
    pad = tokenizer.pad_token_id
    for step in range(steps):
        s = TRAIN_SEED_OFFSET + seed * 1_000_003 + step
        if is_scene_step(step, scene_fraction):
            pairs = scene_pairs(s, scene_bs)
            renders = {}
            pixels = []
            for scene, _ in pairs:
                if scene not in renders:
                    renders[scene] = encoder.preprocess(scene.render())["pixel_values"]
                pixels.append(renders[scene])
            seqs = [encode(tokenizer, scene_prompt(qa.question), qa.answer) for _, qa in pairs]
            cells = torch.tensor([cell_labels(scene) for scene, _ in pairs])
            yield (*batch_tensors(seqs, pad), torch.cat(pixels), cells)
        else:
            fillers = report_fillers(step / steps, curriculum)
            yield (*batch_tensors(document_sequences(tokenizer, s, doc_bs, fillers), pad), None, None)


def document_sequences(tokenizer, seed: int, n: int, fillers: tuple[int, int] = REPORT_FILLERS
                       ) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """``n`` reports, each followed by three instructions and answers, trained on every token but
    the report's own values: packing several answers per report and predicting the report itself
    (whose names and values recur) teaches copying far sooner than the answers alone; a value where
    the report states it cannot be predicted, and training on it only teaches a prior that competes
    with copying. Inference asks one question."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        report = random_report(rng, fillers)
        qas = rng.sample(report_questions(report), 3)
        prompt = document_prompt(report, qas[0].question)
        ids, _ = encode(tokenizer, prompt, qas[0].answer)
        for qa in qas[1:]:
            more, _ = encode(tokenizer, f"\ninstruction: {qa.question}\nanswer:", qa.answer)
            ids += more
        values = value_spans(report)
        offsets = tokenizer(prompt, return_offsets_mapping=True)["offset_mapping"]
        hidden = [i for i, (a, b) in enumerate(offsets) if any(a < end and b > start for start, end in values)]
        bounds = [0, *hidden, len(ids)]
        out.append((ids, [(a + 1, b) for a, b in zip(bounds, bounds[1:]) if b > a + 1]))
    return out


def value_spans(report) -> list[tuple[int, int]]:
    """Character spans of the report's name and record values in its text."""
    text = report.text
    stated = [(f"report on {report.name}.", report.name)] + [
        (f"{field} {getattr(report, field)}.", getattr(report, field))
        for field in ("population", "founded", "mayor", "river", "industry")]
    spans = []
    for phrase, value in stated:
        start = text.index(phrase) + len(phrase) - len(value) - 1
        spans.append((start, start + len(value)))
    return spans


def corpus(seed: int) -> list[str]:
    texts = []
    for scene, qa in scene_examples(TRAIN_SEED_OFFSET + seed, 4000):
        texts.append(scene_prompt(qa.question) + " " + qa.answer)
    for report, qa in document_examples(TRAIN_SEED_OFFSET + seed, 1500):
        texts.append(document_prompt(report, qa.question) + " " + qa.answer)
    return texts


def train_vlm(args, tokenizer, history: dict) -> MmkvVLM:
    config = vlm_config(args, tokenizer)
    torch.manual_seed(args.seed)
    model = MmkvVLM(config)
    with torch.no_grad():  # start with the image in view (gates start closed otherwise)
        for name, p in model.language_model.named_parameters():
            if name.endswith("_gate"):
                p.fill_(0.5)
    encoder = OpenClipEncoder(model.vision_tower, model.project, model.image_size, identity="train")
    probe = torch.nn.Linear(model.vision_tower.conv1.out_channels, 1 + len(SHAPES) * len(COLOURS) * len(SIZES))
    params = list(model.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    batches = make_batches(tokenizer, encoder, args.seed, args.steps, args.scene_batch, args.doc_batch,
                           args.scene_fraction, args.curriculum)
    bar = tqdm(batches, total=args.steps, desc="vlm", mininterval=5)
    for step, (ids, labels, pixels, cells) in enumerate(bar):
        for group in opt.param_groups:
            group["lr"] = schedule(step, args.steps, args.lr)
        final, early, seen = vlm_losses(model, probe, ids, labels, pixels, cells, args.early_exit_layers)
        loss = final + args.early_exit_weight * sum(early) + seen
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        key = "scene" if pixels is not None else "document"
        history[f"vlm_{key}"].append((step, final.item()))
        for k, e in zip(args.early_exit_layers, early):
            history[f"vlm_{key}_exit{k}"].append((step, e.item()))
        bar.set_postfix(loss=f"{final.item():.3f}", early=f"{early[0].item():.3f}")
    return model.eval()


def train_draft(args, tokenizer, history: dict) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed + 1)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.draft_lr, weight_decay=0.01)
    model.train()
    steps = args.draft_steps
    batches = _text_batches(tokenizer, args.seed + 7, steps, args.scene_batch, args.doc_batch,
                            args.scene_fraction, args.curriculum)
    for step, (ids, labels) in enumerate(tqdm(batches, total=steps, desc="draft", mininterval=5)):
        for group in opt.param_groups:
            group["lr"] = schedule(step, steps, args.draft_lr)
        loss = lm_loss(model(input_ids=ids).logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history["draft"].append((step, loss.item()))
    return model.eval()


def _text_batches(tokenizer, seed: int, steps: int, scene_bs: int, doc_bs: int, scene_fraction: float,
                  curriculum: float):
    """The draft sees the same text without the picture, reports short at first as the VLM's."""
    pad = tokenizer.pad_token_id
    for step in range(steps):
        s = TRAIN_SEED_OFFSET + seed * 1_000_003 + step
        if is_scene_step(step, scene_fraction):
            seqs = [encode(tokenizer, scene_prompt(qa.question), qa.answer)
                    for _, qa in scene_pairs(s, scene_bs)]
        else:
            seqs = document_sequences(tokenizer, s, doc_bs, report_fillers(step / steps, curriculum))
        yield batch_tensors(seqs, pad)


def train_draft_only(args) -> None:
    """Retrain ``<out>/tiny-draft`` on ``<out>/tiny-vlm``'s tokenizer (the one a full run would
    train: it is deterministic from the seed), the VLM untouched; its loss curve goes to
    ``<out>/draft_loss.png`` and its settings, time and final loss to ``training.json``'s
    ``draft`` entry."""
    start = time.time()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out / "tiny-vlm")
    history = {"draft": []}
    draft = train_draft(args, tokenizer, history)
    draft.save_pretrained(args.out / "tiny-draft")
    tokenizer.save_pretrained(args.out / "tiny-draft", save_jinja_files=False)
    plot(history, args.out / "draft_loss.png")
    record = args.out / "training.json"
    summary = json.loads(record.read_text()) if record.exists() else {}
    summary["draft"] = {"retrained_alone": True, "draft_steps": args.draft_steps, "draft_lr": args.draft_lr,
                        "curriculum": args.curriculum, "seed": args.seed,
                        "minutes": round((time.time() - start) / 60, 1),
                        "final_loss": history["draft"][-1][1]}
    record.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'tiny-draft'} in {summary['draft']['minutes']} minutes; final loss "
          f"{summary['draft']['final_loss']:.3f}")


def plot(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, points in history.items():
        if points:
            steps, losses = zip(*points)
            window = max(1, len(losses) // 50)
            smooth = [sum(losses[max(0, i - window):i + 1]) / len(losses[max(0, i - window):i + 1])
                      for i in range(len(losses))]
            ax.plot(steps, smooth, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (smoothed)")
    ax.set_title("mmkv tiny models: training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=7000)
    parser.add_argument("--draft-steps", type=int, default=6000)
    parser.add_argument("--scene-batch", type=int, default=48)
    parser.add_argument("--doc-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--early-exit-weight", type=float, default=0.5)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cross-layers", type=int, nargs="+", default=[1, 4, 7])
    parser.add_argument("--early-exit-layers", type=int, nargs="+", default=[2, 3],
                        help="draft depths trained LayerSkip-style; the first is the model's default")
    parser.add_argument("--scene-fraction", type=float, default=0.31)
    parser.add_argument("--curriculum", type=float, default=0.5,
                        help="fraction of training over which reports grow to full length")
    parser.add_argument("--patch-name-scale", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--smoke", action="store_true", help="a few tiny steps, to test the script")
    parser.add_argument("--draft-only", action="store_true",
                        help="retrain only <out>/tiny-draft, on <out>/tiny-vlm's tokenizer")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.draft_steps, args.scene_batch, args.doc_batch = 4, 2, 4, 2
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    if args.draft_only:
        train_draft_only(args)
        return
    start = time.time()
    tokenizer = train_tokenizer(corpus(args.seed), 200 if args.smoke else args.vocab)
    history = {f"vlm_{kind}{exit}": [] for kind in ("scene", "document")
               for exit in ["", *(f"_exit{k}" for k in args.early_exit_layers)]}
    history["draft"] = []
    vlm = train_vlm(args, tokenizer, history)
    draft = train_draft(args, tokenizer, history)
    vlm_dir, draft_dir = args.out / "tiny-vlm", args.out / "tiny-draft"
    vlm.save_pretrained(vlm_dir)
    tokenizer.save_pretrained(vlm_dir, save_jinja_files=False)  # the chat template in its config
    draft.save_pretrained(draft_dir)
    tokenizer.save_pretrained(draft_dir, save_jinja_files=False)
    plot(history, args.out / "loss.png")
    minutes = round((time.time() - start) / 60, 1)
    held_out = evaluate(vlm_dir, *((4, 2) if args.smoke else (200, 100)))
    (args.out / "training.json").write_text(json.dumps(
        {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
         "minutes": minutes, "final_losses": {k: v[-1][1] for k, v in history.items() if v},
         "held_out": held_out}, indent=2))
    print(f"wrote {vlm_dir}, {draft_dir} and {args.out / 'loss.png'} in {minutes} minutes; held-out "
          f"accuracy: scenes {held_out['scene_accuracy']}, documents {held_out['document_accuracy']}")


if __name__ == "__main__":
    main()
