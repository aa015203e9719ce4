"""The report's BLiMP section: RUN_DIR/blimp.json (`glm5lab eval blimp RUN_DIR`) as a table beside the
published models (`glm5lab.evals.blimp.render_table`); nothing when the file is absent."""

from __future__ import annotations

import json
from pathlib import Path

FILE = "blimp.json"

SHAKESPEARE_NOTE = ("This run trained on the default corpus, Early Modern English (42 Shakespeare plays and poems, "
                    "about 5 MB; the default run sees about half of it once): BLiMP's sentences are modern American "
                    "English built from a generated vocabulary (modern names, nouns and verbs the plays mostly lack), "
                    "so many of its words are rare or unseen for this model, and some contrasts it tests are "
                    "grammatical or different in the training text (pronouns and agreement with thou/thee, inverted "
                    "questions without do, free word order in verse). Read the figure as a floor for a modern-English "
                    "benchmark, not as what the architecture reaches on a modern corpus.")


def load_record(run_dir) -> dict | None:
    """RUN_DIR/blimp.json parsed, or None when absent or not a `glm5lab eval blimp` result (no "overall")."""
    path = Path(run_dir) / FILE
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("overall"), dict) else None


def render_section(result: dict | None, default_corpus: bool = False) -> str:
    """'## BLiMP' with the per-phenomenon table and the overall figure; '' when `result` is None."""
    if result is None:
        return ""
    from glm5lab.evals.blimp import render_table

    o = result["overall"]
    subset = f" **Subset**: {result['subset']}." if result.get("subset") else ""
    return (f"## BLiMP\n\n`glm5lab eval blimp` ({result['pairs']:,} minimal pairs, {result.get('model', '?')}):{subset} "
            "a pair is right when the whole good sentence has the higher log-probability (the paper's simple LM "
            f"method; every token scored, the first after {result.get('prefix_token', '?')!r}). Overall "
            f"**{100 * o['accuracy']:.1f}%** (95% CI {100 * o['ci95'][0]:.1f}-{100 * o['ci95'][1]:.1f}, normal "
            "approximation over pairs), the mean over paradigms; per phenomenon (the paper's 12 groups), with the "
            "published 5-gram, LSTM, Transformer-XL and GPT-2 figures (Warstadt et al., TACL 2020, Table 3):\n\n"
            + render_table(result) + ("\n" + SHAKESPEARE_NOTE + "\n" if default_corpus else ""))
