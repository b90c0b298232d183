"""The studies behind docs/results.md: the pre-registered comparisons (comparison.py), the
recipe, the diagnostic, the anatomy of a run, the base model's figures, the pairwise and VLM
judges, and the summaries. Each is a script that drives recast.py; nothing imports them but their
tests. Beside them, prompts.py writes the generated prompt sets of prompts/ (docs/prompts.md)."""
