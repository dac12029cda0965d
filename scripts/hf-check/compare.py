"""Loads a `hetpar export` directory in HF transformers and scores a held-out set with it,
next to `hetpar eval` of the same checkpoint: the same loss and the same right tokens say
the export is the model hetpar trained.

Optional, never in CI (PyTorch, transformers and Pillow from PyPI):

    pip install torch transformers pillow
    hetpar train --steps 60 --out /tmp/run
    hetpar export /tmp/run --hf /tmp/hf
    python scripts/hf-check/compare.py --hf /tmp/hf --data ~/.cache/hetpar/synth-... \
        --hetpar target/release/hetpar --ckpt /tmp/run

The LLM loads as its exported class, the vision tower as `SiglipVisionModel` and the audio
tower as `WhisperEncoder`, each from its own directory; the two LLaVA projectors are
applied by hand. Each record goes through hetpar's chat template
(`crates/hetpar-data/src/chat.rs`): a role marker, the text, `<|end|>` per turn, each
placeholder expanded to its encoder's rows; the loss and accuracy are over the assistant
text and its closing marker, position i predicting token i + 1. Pixels and log-mel
features come from each tower's `preprocessor_config.json`, through `AutoImageProcessor`
and `AutoFeatureExtractor` (given the export's `clip_samples` as `max_length`: the demo's
clips are 1.28 s, which Whisper's `chunk_length` of whole seconds cannot say). 16-bit WAV
only, as the synthetic set writes.
"""

import argparse
import json
import subprocess
import wave

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file
from transformers import (AutoFeatureExtractor, AutoImageProcessor, AutoModelForCausalLM, AutoTokenizer,
                          SiglipVisionModel)
from transformers.models.whisper.modeling_whisper import WhisperEncoder

F = torch.nn.functional
ROLE = {"human": "<|user|>", "gpt": "<|assistant|>", "system": "<|system|>"}
PLACEHOLDERS = ("<image>", "<audio>")


def projector(weights, prefix, h):
    """The LLaVA projector: linear, exact GELU, linear."""
    w = lambda n: weights[f"{prefix}.{n}"]
    return F.linear(F.gelu(F.linear(h, w("linear_1.weight"), w("linear_1.bias"))),
                    w("linear_2.weight"), w("linear_2.bias"))


def read_wav(path):
    """A 16-bit WAV's samples in [-1, 1], channels averaged (as hetpar reads them)."""
    with wave.open(path) as w:
        assert w.getframerate() == 16000 and w.getsampwidth() == 2, f"{path}: 16 kHz 16-bit only"
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
        return x.reshape(-1, w.getnchannels()).mean(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="the `hetpar export --hf` directory")
    ap.add_argument("--data", required=True, help="a directory holding heldout.json and its media")
    ap.add_argument("--hetpar", help="the hetpar binary, to run `hetpar eval` alongside")
    ap.add_argument("--ckpt", help="the checkpoint (or run directory) that was exported")
    a = ap.parse_args()
    transformers.logging.set_verbosity_error()
    llm_dir = f"{a.hf}/llm"
    tok = AutoTokenizer.from_pretrained(llm_dir)
    llm = AutoModelForCausalLM.from_pretrained(llm_dir).eval()
    added = {t["content"]: t["id"] for t in json.load(open(f"{llm_dir}/tokenizer.json"))["added_tokens"]}
    vision = audio = None
    try:
        vision = SiglipVisionModel.from_pretrained(f"{a.hf}/vision").eval()
        processor = AutoImageProcessor.from_pretrained(f"{a.hf}/vision")
        vcfg = vision.config
        image_rows = (vcfg.image_size // vcfg.patch_size) ** 2
        vision_w = load_file(f"{a.hf}/vision/model.safetensors")
    except OSError:
        pass
    try:
        audio = WhisperEncoder.from_pretrained(f"{a.hf}/audio").eval()
        features = AutoFeatureExtractor.from_pretrained(f"{a.hf}/audio")
        audio_rows = audio.config.max_source_positions
        audio_w = load_file(f"{a.hf}/audio/model.safetensors")
    except OSError:
        pass
    seq_len = llm.config.max_position_embeddings
    totals = {}
    for r in json.load(open(f"{a.data}/heldout.json")):
        ids, learned, slots, asked = [], [], [], "text"
        for turn in r["conversations"]:
            if turn["from"] != "gpt":
                v = turn["value"]
                asked = "image" if "<image>" in v else "audio" if "<audio>" in v else "text"
            learn = asked if turn["from"] == "gpt" else None
            ids.append(added[ROLE[turn["from"]]])
            learned.append(None)
            rest = turn["value"]
            while True:
                hits = sorted((rest.find(p), p) for p in PLACEHOLDERS if p in rest)
                piece = rest[:hits[0][0]] if hits else rest
                text = tok.encode(piece, add_special_tokens=False)
                ids += text
                learned += [learn] * len(text)
                if not hits:
                    break
                at, p = hits[0]
                rows = image_rows if p == "<image>" else audio_rows
                slots.append((p, len(ids), rows))
                ids += [added[p]] * rows
                learned += [None] * rows
                rest = rest[at + len(p):]
            ids.append(added["<|end|>"])
            learned.append(learn)
        assert len(ids) <= seq_len, f"record {r['id']}: {len(ids)} tokens past seq_len {seq_len}"
        media = {k: (r[k] if isinstance(r[k], list) else [r[k]]) for k in ("image", "audio") if k in r}
        with torch.no_grad():
            embeds = llm.get_input_embeddings()(torch.tensor([ids]))
            used = {"<image>": 0, "<audio>": 0}
            for p, at, rows in slots:
                kind = p.strip("<>")
                path = f"{a.data}/{media[kind][used[p]]}"
                used[p] += 1
                if p == "<image>":
                    pixels = processor(images=Image.open(path), return_tensors="pt").pixel_values
                    h = vision(pixel_values=pixels).last_hidden_state
                    embeds[0, at:at + rows] = projector(vision_w, "multi_modal_projector", h)[0]
                else:
                    mel = features(read_wav(path), sampling_rate=16000, return_tensors="pt",
                                   max_length=features.clip_samples).input_features
                    h = audio(mel).last_hidden_state
                    embeds[0, at:at + rows] = projector(audio_w, "audio_projector", h)[0]
            logits = llm(inputs_embeds=embeds).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        for j in range(1, len(ids)):
            if learned[j] is not None:
                t = totals.setdefault(learned[j], [0.0, 0, 0])
                t[0] -= logp[j - 1, ids[j]].item()
                t[1] += 1
                t[2] += int(logits[j - 1].argmax().item() == ids[j])
    nll, n, right = (sum(t[i] for t in totals.values()) for i in range(3))
    print(f"HF transformers {transformers.__version__}: loss {nll / n:.9f}, {right} of {n} target tokens right")
    for kind, (k_nll, k_n, k_right) in sorted(totals.items()):
        print(f"  {kind}: loss {k_nll / k_n:.9f}, {k_right} of {k_n}")
    if a.hetpar and a.ckpt:
        out = subprocess.run([a.hetpar, "eval", a.ckpt, "--data", a.data, "--json"],
                             check=True, capture_output=True, text=True).stdout
        e = json.loads(out)
        print(f"hetpar eval: loss {e['loss']:.9f}, {round(e['token_accuracy'] * e['targets'])} "
              f"of {e['targets']} target tokens right")


if __name__ == "__main__":
    main()
