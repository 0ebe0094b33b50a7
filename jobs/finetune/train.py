"""A LoRA fine-tune of a small BERT classifier on generated delivery notes (delivered, failed, delayed).

Ported as a Hugging Face + peft script is: from_pretrained of a model folder, a LoraConfig, AdamW
over the adapters, a linear warm-up schedule. Only the loop's edges change: run.wrap, run.track,
run.optimize, run.loader and run.steps, so a session killed at any step resumes as the same run.

The "pretrained" base is a freshly initialised tiny BERT, built once with run.stage and written as
the folder save_pretrained makes (config.json, model.safetensors, tokenizer.json). With a real base
attached as a Kaggle Model, that folder is `run.input("<owner>/<model>")` and `pretrained_base`
goes away; everything after it stays as it is.
"""

import os

# Never ask the hub: a Kaggle session runs with the internet off, and a smoke run must not reach out.
# huggingface_hub reads these once, when it is first imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # tqdm bars per load would fill the log

import shutil  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig, TaskType, get_peft_model  # noqa: E402
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    PreTrainedTokenizerFast,
    get_linear_schedule_with_warmup,
)

# peft 0.21 reads a property that transformers 5 deprecates; the warning is theirs, once per wrap.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

CLASSES = ["delivered", "failed", "delayed"]
TEMPLATES = {
    "delivered": [
        "parcel left at door {n}, signed by {name}",
        "{goods} handed to {name} at {place}",
        "{goods} delivered to reception at {place}, signed by {name}",
    ],
    "failed": [
        "no answer at door {n}, card left for {name}",
        "address not found near {place}, {goods} returned",
        "{goods} refused by {name} at {place}",
    ],
    "delayed": [
        "{goods} held at {place}, van broke down",
        "rescheduled to day {n}, road closed near {place}",
        "{goods} waiting at {place} for customs, {name} informed",
    ],
}
PLACES = ["Leeds depot", "Bristol hub", "Glasgow yard", "Cardiff store", "York depot", "Hull dock"]
GOODS = ["pallets of flour", "crates of apples", "drums of oil", "rolls of cable", "boxes of tiles"]
NAMES = ["K. Patel", "A. Jones", "M. Okafor", "S. Novak", "L. Chen", "R. Silva"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] first: BertConfig's pad_token_id is 0


def pre_tokenizer():
    # Words and punctuation, every digit its own token: "DN-10421" is dn - 1 0 4 2 1.
    return pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over every word the notes can hold, built in code (nothing downloaded)."""
    blanks = dict.fromkeys(["n", "name", "goods", "place"], "")
    texts = [t.format(**blanks) for ts in TEMPLATES.values() for t in ts] + PLACES + GOODS + NAMES + ["DN-0123456789:"]
    words = sorted({w for text in texts for w, _ in pre_tokenizer().pre_tokenize_str(text.lower())})
    vocab = {w: i for i, w in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def build_base(p):
    """The files of a pretrained model folder, as uint8 arrays keyed by file name (one run.stage entry)."""
    torch.manual_seed(p["seed"])  # the base's initial weights; the training RNGs are seeded after
    tokenizer = make_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=p["hidden"], num_hidden_layers=p["layers"],
                        num_attention_heads=p["heads"], intermediate_size=4 * p["hidden"],
                        max_position_embeddings=p["max_len"], num_labels=len(CLASSES),
                        id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)})
    with tempfile.TemporaryDirectory() as tmp:
        BertForSequenceClassification(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return {name: np.fromfile(Path(tmp, name), dtype=np.uint8) for name in sorted(os.listdir(tmp))}


def pretrained_base(run, p) -> Path:
    """The staged base as a folder from_pretrained can read, written once per working dir."""
    files = run.stage("base", {"seed": p.seed, "hidden": p.hidden, "layers": p.layers, "heads": p.heads,
                               "max_len": p.max_len, "words": sorted(make_tokenizer().get_vocab())}, build_base)
    folder = run.working / "base-model"
    if not folder.exists():
        # Written beside and renamed into place: with two ranks both write, the first rename wins.
        tmp = Path(tempfile.mkdtemp(prefix="base-model.tmp-", dir=run.working))
        for name, data in files.items():
            (tmp / name).write_bytes(np.asarray(data).tobytes())
        try:
            tmp.rename(folder)
        except OSError:  # the other rank's folder is in place: the same bytes
            shutil.rmtree(tmp)
    return folder


def make_notes(p):
    """p['n_notes'] distinct labelled notes (each has its own number); 10% of them form the validation split."""
    rng = np.random.default_rng(p["seed"])
    texts, labels = [], []
    for i in range(p["n_notes"]):
        label = int(rng.integers(len(CLASSES)))
        templates = TEMPLATES[CLASSES[label]]
        body = templates[rng.integers(len(templates))].format(
            n=int(rng.integers(1, 100)), name=NAMES[rng.integers(len(NAMES))],
            goods=GOODS[rng.integers(len(GOODS))], place=PLACES[rng.integers(len(PLACES))])
        texts.append(f"DN-{10000 + i}: {body}")
        labels.append(label)
    texts, labels = np.array(texts), np.array(labels, dtype=np.int64)
    order = rng.permutation(len(texts))
    n_val = max(1, len(texts) // 10)
    val, train = order[:n_val], order[n_val:]
    return {"train_labels": labels[train], "train_texts": texts[train],
            "val_labels": labels[val], "val_texts": texts[val]}


def main(run):
    p = run.params
    folder = pretrained_base(run, p)
    torch.manual_seed(p.seed)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = run.stage("notes", {"n_notes": max(400, int(p.n_notes * run.fraction)), "seed": p.seed}, make_notes)

    def encode(texts, labels):
        enc = tokenizer([str(t) for t in texts], padding="max_length", truncation=True, max_length=p.max_len,
                        return_tensors="pt")
        return TensorDataset(enc["input_ids"], enc["attention_mask"], torch.from_numpy(np.array(labels)))

    train = encode(data["train_texts"], data["train_labels"])
    val_ids, val_mask, val_y = (t.to(run.device) for t in encode(data["val_texts"], data["val_labels"]).tensors)
    loader = run.loader(train, batch_size=p.batch, shuffle=True, drop_last=True)
    run.check(batch=(train.tensors[0][: p.batch], train.tensors[2][: p.batch]), x_shape=(None, p.max_len),
              x_dtype=torch.int64, num_classes=len(CLASSES),
              splits={"train": data["train_texts"], "val": data["val_texts"]})

    # The base stays frozen; LoRA adds rank-r updates to the attention's query and value projections,
    # and peft trains the new classifier head in full (modules_to_save, for a SEQ_CLS task).
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    lora = LoraConfig(task_type=TaskType.SEQ_CLS, r=p.lora_r, lora_alpha=p.lora_alpha,
                      lora_dropout=p.lora_dropout, target_modules=["query", "value"])
    model = get_peft_model(model, lora)
    if run.is_main:
        model.print_trainable_parameters()
    # On run.device; in DistributedDataParallel when train.gpus gives the job several ranks.
    model = run.wrap(model)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=p.lr, weight_decay=0.01)
    schedule = get_linear_schedule_with_warmup(optimizer, p.warmup, p.steps)
    run.track(model=model, scheduler=schedule)
    trainer = run.optimize(optimizer, clip=1.0)

    for step in run.steps(p.steps):
        model.train()
        ids, mask, y = (t.to(run.device) for t in next(loader))
        with run.autocast():
            loss = model(input_ids=ids, attention_mask=mask, labels=y).loss
        trainer.backward(loss)
        trainer.step()
        schedule.step()
        run.log(loss=loss.item(), lr=schedule.get_last_lr()[0])
        if run.every(p.eval_every):
            model.eval()
            with torch.no_grad(), run.autocast():
                logits = model(input_ids=val_ids, attention_mask=val_mask).logits
            run.log(val_loss=torch.nn.functional.cross_entropy(logits.float(), val_y).item(),
                    val_acc=(logits.argmax(1) == val_y).float().mean().item())
