"""Write a weightless Qwen3-Omni model folder for benchmarks with random weights: config.json (the
full-size Qwen3-Omni-30B-A3B-Instruct, or a preset), generation_config.json, and the tokenizer and
processor files. Serve it with `omnistage serve DIR --load-format dummy`; `omnistage bench --backend hf
--model-dir DIR` builds transformers' model on the same seeded weights.

usage: python scripts/bench_model_dir.py OUT_DIR [--preset tiny]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_model_dir(out: Path, preset: str | None = None) -> Path:
    import transformers

    from omnistage.models.qwen3_omni.make_tiny import GENERATION_CONFIG
    from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG
    from omnistage.models.qwen3_omni.presets import preset_config
    from omnistage.models.qwen3_omni.processor_files import write_processor_files

    config = preset_config(preset) if preset else json.loads(FULL_SIZE_CONFIG.read_text())
    # NOTE: without transformers_version, transformers 5.17 warns that the tokenizer has "an incorrect regex"
    config["transformers_version"] = transformers.__version__
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    write_processor_files(out, config)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--preset", default=None, help="a tiny preset instead of the full-size config")
    args = p.parse_args()
    print(write_model_dir(args.out_dir, args.preset))


if __name__ == "__main__":
    main()
