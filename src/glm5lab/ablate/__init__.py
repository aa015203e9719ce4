"""The report's ablations re-run at CPU scale: `glm5lab ablate STUDY [--quick]`.

Studies (`runner.STUDIES`): mla, dsa, swa, efficient, mtp, indexcache, and baseline (the `small` preset against a
dense GPT). Each trains small models (`models.study_config`) on Shakespeare text plus MQAR rows (`workbench`) with
the same step as `glm5lab train` (`fit`), scores them (`measure`), judges every comparison by one rule over seeds
(`stats`), and writes a markdown table with the report's figures (`report_figures`) beside ours, a PNG and the raw
numbers (`results`). `summary` builds the README's one-table summary from those raw numbers.
"""

from glm5lab.ablate.runner import STUDIES, StudyArgs, run_study

__all__ = ["STUDIES", "StudyArgs", "run_study"]
