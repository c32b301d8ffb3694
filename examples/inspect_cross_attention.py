"""Where an mmkv_vlm looks: first cross-attention layer's weights over the image patches.

    python examples/inspect_cross_attention.py                 # the bundled model
    python examples/inspect_cross_attention.py --model DIR --seed 5

Renders one synthetic scene, asks "what is at the <cell>?" for several cells and prints, for each
question, the model's answer and every head's attention over the patches (one per grid cell, in
reading order) at the position that predicts the answer. A model that reads positions attends to
the asked cell; one whose weights do not change with the question reads the scene as a bag of
shapes (as a model trained without patch names did: it answered counts and colours, not positions).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from transformers import AutoTokenizer

from mmkv.bundled import BUNDLED_MODEL
from mmkv.models import MmkvVLM
from mmkv.synthetic import POSITIONS, random_scene, scene_prompt
from vision import OpenClipEncoder


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--cells", default="top left,centre,bottom right")
    args = parser.parse_args()
    model = MmkvVLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lm = model.language_model
    lm.config._attn_implementation = "eager"  # returns the attention weights
    layer = lm.config.cross_attention_layers[0]
    weights = {}
    lm.model.layers[layer].cross_attn.register_forward_hook(
        lambda module, inputs, output: weights.update(last=output[1]))
    scene = random_scene(random.Random(args.seed))
    print("scene:", scene.describe())
    encoder = OpenClipEncoder(model.vision_tower, model.project, model.image_size, identity="inspect")
    states = model.image_features(encoder.preprocess(scene.render())["pixel_values"])
    for cell in args.cells.split(","):
        if cell not in POSITIONS:
            parser.error(f"--cells: {cell!r} is not one of {POSITIONS}")
        question = f"what is at the {cell}?"
        ids = torch.tensor([tokenizer.encode(scene_prompt(question))])
        logits = lm(input_ids=ids, **model.image_inputs(states, ids.shape[1])).logits
        print(f"\n{question}  truth: {scene.answer(question)!r}  first answer token: "
              f"{tokenizer.decode(logits[0, -1].argmax())!r}")
        for head, row in enumerate(weights["last"][0, :, -1]):
            print(f"  layer {layer} head {head}: " + " ".join(f"{w:.2f}" for w in row.tolist()))


if __name__ == "__main__":
    main()
