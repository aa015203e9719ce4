"""`glm5lab report RUN_DIR`: one markdown file with PNGs for a training run (and the evaluation and
ablation results beside it), covering the seed's closing checklist: quality, training tokens,
the parameter counting convention, KV and index state bytes, prefill and decode throughput with
their batch and length, kernel and library versions, hardware, seeds."""

from glm5lab.report.collect import NotARunError, RunRecord, load_run
from glm5lab.report.write import write_report

__all__ = ["NotARunError", "RunRecord", "load_run", "write_report"]
