"""ReCAST in a plain DiffusionNFT-style loop: one epoch on the toy world, written out by hand.

    python examples/recast_in_your_loop.py      # CPU or one GPU, no network

What a trainer adds (docs/use_in_your_trainer.md): keep the step predictions x̂0 of the rollout,
score every reward on them, renyi_gains → gains, recast_weights → W, unit_joint_optimality → r
per reward, and pass (t_index, r, W) to nft_loss where a single-advantage loop passes one r per
image.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if __name__ == "__main__" and DEVICE.type == "cpu":
    # On CPU tensors nft_loss and renyi_gains run their Triton kernels in the interpreter only if
    # TRITON_INTERPRET=1 is set before triton is first imported; without it they fall back to
    # their PyTorch references (reference_nft_loss, reference_renyi_gains), same results.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import rewards  # noqa: E402
from recast import pooled_spread, recast_weights, unit_free, unit_joint_optimality  # noqa: E402
from recast_kernels.nft_loss import nft_loss  # noqa: E402
from recast_kernels.renyi import renyi_gains  # noqa: E402
from worlds import toyworld  # noqa: E402


def main(n_prompts=4, G=4, T=6, lam=(0.4, 0.2, 0.2, 0.2), beta=0.1, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    # worlds/toy_model/: the policy θ, the old θ_old (samples) and the frozen reference
    world = toyworld.ToyWorld(DEVICE)
    reward_fns = {n: rewards.get(n, DEVICE) for n in world.reward_names}  # K = 4 rewards
    lam = torch.tensor(lam, dtype=torch.float64)  # (K,) budgets
    params = list(world.trainable.parameters())
    opt = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0)
    sigmas = world.sigmas(T)  # (T+1,) fp32, t_0 = 1 > ... > t_T = 0

    # 1. Rollout with the old policy: G images per prompt (contiguous), and x̂0 at every step.
    idx = torch.randint(len(world.train_prompts), (n_prompts,), generator=gen).tolist()
    prompts = [world.train_prompts[j] for j in idx for _ in range(G)]  # N = n_prompts · G
    cond = world.encode(prompts)
    x = torch.randn(len(prompts), *world.latent_shape, generator=gen).to(DEVICE)
    preds = []
    with torch.no_grad():
        for i in range(T):  # Euler; any sampler works if it keeps x̂0_i = x_t_i - t_i v_old
            v = world.v("old", x, cond, sigmas[i].expand(len(x)))
            preds.append(x - sigmas[i] * v)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    x0, preds = x, torch.stack(preds)  # (N, C, H, W), (T, N, C, H, W)

    # 2. Every reward on the final images and on the step predictions x̂0_1 … x̂0_{T-1}.
    def score(images):  # (K, N) fp32
        return torch.stack([rewards.score(n, fn, world.decode(images), prompts)
                            for n, fn in reward_fns.items()])  # fmt: skip

    final = score(x0)
    steps = [torch.zeros_like(final)] + [score(p) for p in preds[1:]]  # column 0 is never read
    scores = torch.stack([*steps, final], 1)  # (K, T+1, N)

    # 3. Gains per (reward, step), the weight matrix W, and the optimality r per reward.
    # the gains read every score over its reward's within-group spread pooled over the batch
    # (as unit-joint's r does): in no units, so the same in any (recast.gain_scores)
    D, gains = renyi_gains(unit_free(scores, pooled_spread(final, G)), G)  # (K, T+1), (K, T)
    W = recast_weights(gains, lam, shift=1).to(DEVICE)  # (K, T) fp32: rows λ, columns 1/T;
    # shift=1: gain g_i-1 credited to timestep i, recast.py's default (DESIGN §4)
    # --normalize unit-joint, recast.py's default (DESIGN §3): each reward divided by its
    # within-group spread pooled over the batch (every rank's groups: gather `final` first under
    # DDP), then each centred score over the group spread of the λ-weighted sum, so λ weighs
    # rewards in no units and W = λ/T would be the summed reward of those unit-free scores;
    # nft_loss clamps the mix to [0, 1]. group_optimality(final, G) is --normalize per-reward.
    r = unit_joint_optimality(final, lam / lam.sum(), G)  # (K, N) fp32

    # 4. NFT update on a random half of the N·T (image, timestep) pairs, one optimizer step.
    pairs = torch.randperm(len(x0) * T, generator=gen)[: len(x0) * T // 2]
    n, i = (pairs // T).to(DEVICE), (pairs % T).to(DEVICE)  # the timestep index stays with n
    t = sigmas[i]  # (B,) fp32
    eps = torch.randn(len(n), *world.latent_shape, generator=gen).to(DEVICE)
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0[n] + t.view(-1, 1, 1, 1) * eps
    c = tuple(cc[n] for cc in cond)
    v_theta = world.v("policy", x_t, c, t)
    with torch.no_grad():
        v_old = world.v("old", x_t, c, t)
    loss = nft_loss(v_theta, v_old, x0[n], eps, t, i, r[:, n].T, W, beta=beta, adv_clip_max=5.0)
    before = [p.detach().clone() for p in params]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    world.update_old(0.001)  # θ_old ← d θ_old + (1 - d) θ, d = min(0.001 · opt. steps, 0.5)
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(params, before, strict=True))

    print(f"W (K × T = {len(lam)} × {T}; rows sum to λ, columns to 1/T):")
    for name, row in zip(world.reward_names, W.tolist(), strict=True):
        print(f"  {name:>10}  " + "  ".join(f"{w:.4f}" for w in row) + f"  | {sum(row):.4f}")
    print(f"loss {loss.item():.4f} on {len(n)} pairs; largest parameter change {moved:.2e}")
    return dict(W=W.cpu(), lam=lam, gains=gains.cpu(), loss=loss.item(), moved=moved)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
