"""Expert parallelism + DDP: each rank holds E/W experts, DDP keeps the rest replicated.

Run (CPU, gloo):
    torchrun --nproc-per-node 2 examples/expert_parallel_ddp.py
    torchrun --nproc-per-node 4 examples/expert_parallel_ddp.py --experts 8 --steps 50
With CUDA devices it uses NCCL and one GPU per rank.

What it shows:
1. build the same model on every rank (same seed), shard every MoE layer with
   `expert_parallel`, then wrap in DDP with the expert tensors excluded and gradients summed;
2. train a small regression task, each rank on its own data; the loss of each rank is divided
   by the world size so the summed gradients are those of the mean loss over ranks;
3. gather the sharded checkpoint to the full layout on every rank, then check on rank 0 that a
   plain, unsharded copy of the model loaded from it gives the same outputs.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from moe_ffn import MoE, MoEConfig
from moe_ffn.parallel import allreduce_sum_hook, exclude_experts_from_ddp, expert_parallel, gather_full_state_dict


class Block(nn.Module):
    """Pre-norm residual block around a MoE FFN."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.dim)
        self.moe = MoE(config)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD + self.moe(self.norm(x_TD))


class Model(nn.Module):
    def __init__(self, config: MoEConfig, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(config) for _ in range(depth)])
        self.head = nn.Linear(config.dim, 1)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x_TD)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    config = MoEConfig(dim=args.dim, hidden_dim=2 * args.dim, num_experts=args.experts, top_k=args.top_k)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Model(config, args.depth).to(device)
    reference = Model(config, args.depth)  # rank 0 checks the gathered checkpoint against it

    for module in model.modules():
        if isinstance(module, MoE):
            expert_parallel(module)  # rank r keeps experts r·E/W … (r+1)·E/W − 1
    exclude_experts_from_ddp(model)  # DDP must not average different ranks' experts together
    ddp = DDP(model)
    # Expert gradients arrive summed over ranks through the all-to-all; sum the replicated
    # parameters' gradients too, instead of DDP's default average.
    ddp.register_comm_hook(None, allreduce_sum_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

    teacher = torch.Generator().manual_seed(1234)
    w_true_D = torch.randn(args.dim, generator=teacher)
    data = torch.Generator().manual_seed(rank)  # every rank sees its own data
    for step in range(args.steps):
        x_TD = torch.randn(args.tokens, args.dim, generator=data)
        y_T = torch.tanh(x_TD @ w_true_D) * x_TD[:, 0]
        x_TD, y_T = x_TD.to(device), y_T.to(device)
        loss = torch.nn.functional.mse_loss(ddp(x_TD), y_T)
        optimizer.zero_grad(set_to_none=True)
        (loss / world).backward()  # Σ over ranks of loss/W: the gradient of the mean loss
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss (mean over {world} ranks) {mean_loss.item() / world:.4f}", flush=True)

    full_state = gather_full_state_dict(model)  # collective: every rank takes part
    x_TD = torch.randn(16, args.dim, generator=data).to(device)
    with torch.no_grad():
        out_sharded_T = ddp(x_TD)
    if rank == 0:
        reference.load_state_dict({k: v.cpu() for k, v in full_state.items()})
        with torch.no_grad():
            out_full_T = reference(x_TD.cpu())
        gate_up = full_state["blocks.0.moe.experts.gate_up_proj"]
        print(f"gathered checkpoint: blocks.0.moe.experts.gate_up_proj {tuple(gate_up.shape)}; "
              f"this rank holds {tuple(model.blocks[0].moe.experts.gate_up_proj.shape)}")
        error = (out_full_T - out_sharded_T.cpu()).abs().max().item()
        print(f"unsharded model from the gathered checkpoint vs expert-parallel model: max |diff| = {error:.2e}")
        if error > 1e-5:
            raise SystemExit("the gathered checkpoint does not reproduce the sharded model")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
