# train_lightning.py: PyTorch Lightning's DDPStrategy with geocomm's hook
import hashlib

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

import geocomm.adapters.torch as gt


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)                  # the same initial weights on every rank
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                       torch.nn.Linear(512, 1))

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class GeocommHookOnCPU(L.Callback):
    """Lightning registers ddp_comm_hook on CUDA only; on CPU register it here."""

    def __init__(self, state):
        self.state = state

    def on_fit_start(self, trainer, module):
        if trainer.strategy.root_device.type == "cpu":
            trainer.strategy.model.register_comm_hook(self.state, gt.geocomm_hook)


model = Regressor()
state = gt.GeocommHookState(model, codec="fp8")   # before any process group exists
strategy = DDPStrategy(process_group_backend="gloo",   # "nccl" on GPUs
                       ddp_comm_state=state, ddp_comm_hook=gt.geocomm_hook)
x = torch.randn(2048, 256, generator=torch.Generator().manual_seed(1))
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].sin()),
                                   batch_size=64)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=20,
                    callbacks=[GeocommHookOnCPU(state)], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, data)                      # under mpirun, torchrun or Lightning's launcher

digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
print(f"rank {trainer.global_rank}: {len(state.telemetry.history)} compressed steps, "
      f"ratio {state.last_step.ratio:.2f}, parameters {digest.hexdigest()[:16]}")
