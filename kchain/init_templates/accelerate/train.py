"""@NAME@: a classifier trained by a Hugging Face Accelerate loop.

Written the way an accelerate script is (the shape of accelerate's nlp_example.py): an Accelerator,
prepare(), a loop over epochs and batches with accumulate(), backward() and clip_grad_norm_(), an
evaluation with gather_for_metrics(). Two lines make it a kchain job, marked `kchain:` below: the
Accelerator comes from run.accelerator(...) with the same arguments, and the epochs from run.epochs(...).
kchain then checkpoints what save_state would (model, optimizer, scheduler, scaler, RNG states), keeps
the training data's shuffle and place, saves on the job's cadence, stops before the session's end and
resumes in the next session at the very batch where it stopped.

Nothing is downloaded: the data is generated (Gaussian blobs). Replace blobs() with your dataset
(reading run.input("your-dataset")) and the model with yours.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def blobs(rows: int, features: int, classes: int, seed: int):
    """Rows drawn around one centre per class, 80% train and 20% validation; replace with your dataset."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 2.0, size=(classes, features))
    labels = rng.integers(classes, size=rows)
    x = torch.from_numpy((centres[labels] + rng.normal(0, 1.5, size=(rows, features))).astype(np.float32))
    y = torch.from_numpy(labels)
    cut = int(0.8 * rows)
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def main(run):
    p = run.params
    # kchain: was Accelerator(mixed_precision="fp16", gradient_accumulation_steps=p.accumulate)
    accelerator = run.accelerator(mixed_precision="fp16", gradient_accumulation_steps=p.accumulate)
    torch.manual_seed(p.seed)  # accelerate's set_seed(p.seed) does this and more
    train_set, val_set = blobs(p.rows, p.features, p.classes, p.seed)
    train_dl = DataLoader(train_set, batch_size=p.batch, shuffle=True, num_workers=p.num_workers)
    eval_dl = DataLoader(val_set, batch_size=128)
    model = nn.Sequential(
        nn.Linear(p.features, p.hidden), nn.ReLU(), nn.Dropout(p.dropout),
        nn.Linear(p.hidden, p.hidden), nn.ReLU(), nn.Dropout(p.dropout),
        nn.Linear(p.hidden, p.classes),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr)
    total = p.epochs * len(train_dl) // p.accumulate  # as nlp_example counts it, before prepare()
    warmup = max(1, total // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1.0 - s / total))  # linear warmup and decay
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)

    for epoch in run.epochs(p.epochs):  # kchain: was range(p.epochs)
        model.train()
        for x, y in train_dl:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:  # an optimizer step ended: one row of the metrics
                accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]})

        model.eval()
        correct = seen = 0
        for x, y in eval_dl:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            correct += (predictions == references).sum().item()
            seen += references.numel()
        accelerator.log({"val_acc": correct / seen})
        accelerator.print(f"epoch {epoch}: accuracy {correct / seen:.3f}")

    if run.finished:  # not after a deadline or SIGTERM stop: the model is final
        accelerator.wait_for_everyone()
        accelerator.save_model(model, run.export_dir)  # model.safetensors of the unwrapped model, rank 0
