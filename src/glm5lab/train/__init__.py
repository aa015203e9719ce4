"""The run: its folder, metrics, progress and summary, the step, stages, recipes, losses and evaluation.
The top room: imports data, parallel and checkpoints; nothing below imports it.
"""
