"""`python -m glm5lab ...`: the same as the `glm5lab` command."""

from glm5lab.cli import main

raise SystemExit(main())
