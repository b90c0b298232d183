"""Run plumbing a reader of recast.py may skip: flags and their errors (cli), checkpoints and
metrics.jsonl (checkpoints), the run folder, its lock, start, resume and stop (rundir), torchrun's
collectives and a lost rank (distributed), seeding, TensorBoard and wandb (tblog), the pictures
(plots), the kept eval images (eval_images), --profile's report (reward_profile) and --export's
LoRA for diffusers (export). Nothing here imports recast.py, the worlds or the rewards.
"""
