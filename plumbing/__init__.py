"""Run plumbing a reader of recast.py may skip: flags and their errors (cli), checkpoints and
metrics.jsonl (checkpoints), the run folder, its lock, start, resume and stop (rundir), torchrun's
collectives and a lost rank (distributed), seeding, TensorBoard (tblog), the pictures (plots), the
kept eval images (eval_images) and --profile's report (reward_profile). Nothing here imports
recast.py, the worlds or the rewards.
"""
