# train_hf.py: a Hugging Face Trainer on the compressed torch.distributed backend
import hashlib
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from geocomm.adapters.torch import backend  # registers the backend "geocomm"

dist.init_process_group("geocomm")            # under torchrun; the Trainer uses this group

torch.manual_seed(0)                          # the same initial weights on every rank
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=128,
                                   n_layer=2, n_head=4))     # from a config: no download
tokens = torch.randint(0, 256, (512, 64), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": t, "labels": t} for t in tokens]
args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=10, use_cpu=True,
                         per_device_train_batch_size=8, learning_rate=1e-3,
                         report_to=[], save_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=data).train()

stats = backend.stats()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
print(f"rank {dist.get_rank()}: {stats.compressed} compressed all-reduces, ratio "
      f"{stats.ratio:.2f}, parameters {digest.hexdigest()[:16]}")
dist.destroy_process_group()
