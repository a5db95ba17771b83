"""Train the demo model shipped in colibri/data/demo/ (so `colibri` runs with no download).

Command (from the repository root, CPU only; 1500 steps at ~0.34 s of one
core's CPU time each, i.e. ~8.5 minutes on an idle machine -- it took 22
minutes wall on a shared, overloaded 2-core box)::

    .venv/bin/python tools/make_demo_model.py            # writes colibri/data/demo/

What it makes: a small Mixtral-architecture MoE (transformers'
MixtralForCausalLM: 4 layers, hidden 128, 8 experts top-2, 512-token
byte-level BPE vocabulary) trained from scratch on a synthetic corpus of
simple children's stories that this script generates from templates
(deterministically; nothing is downloaded). The folder holds config.json,
generation_config.json, model.safetensors (bf16, saved with save_pretrained,
i.e. the hub layout with per-expert `block_sparse_moe.experts.{e}.w1/w2/w3`
tensors), tokenizer.json, tokenizer_config.json (with a chat template) and
special_tokens_map.json, 6.7 MiB in all. The shipped run ended at train loss
0.077 (EMA), held-out loss 0.286 (nats/token; the corpus is very repetitive),
and greedy decoding of "Once upon a time" continues ", there was a little
girl. Her name was Zoe, and she lived in a big farm by the river. One day, Zoe
went to the park to play with friends. She took her kite with her. ..." It is
a demo of the engine, not a useful model.

Everything is seeded, the step count is fixed (not time-bounded) and torch
runs with a fixed thread count, so re-running reproduces the same run on the
same machine; bit-identical weights across CPUs are not guaranteed (BLAS
kernels differ).

Options: --out DIR, --steps N, --dump-corpus FILE (write the corpus and exit),
--threads N.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import MixtralConfig, MixtralForCausalLM

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "colibri" / "data" / "demo"
SEED = 1234

# Same special-token layout and chat template as tests/hf_tiny.py, so chat code
# paths behave the same on the demo and on the test checkpoints.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Model: sized so the bf16 folder stays under 8 MB (6.7 MiB) and 1500 steps fit
# in ~8.5 CPU minutes: 3.48 M parameters, ~1.05 M of them active per token.
MODEL = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    # The load-balancing loss keeps all 8 experts in use, so the demo actually
    # exercises expert routing and caching instead of collapsing onto two.
    "output_router_logits": True,
    "router_aux_loss_coef": 0.02,
}

SEQ_LEN = 256
BATCH = 8
STEPS = 1500
LR = 3e-3
WARMUP = 100

# ---------------------------------------------------------------------------
# Corpus: template stories. Small closed vocabulary and rigid structure are
# what lets a 3 M parameter model write fluent-looking sentences after a few
# CPU minutes.

GIRLS = ["Lily", "Mia", "Anna", "Lucy", "Emma", "Zoe", "Sara", "Kate", "Rosa", "Nina", "Ella", "Amy"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Jack", "Leo", "Tim", "Finn", "Jake", "Noah", "Paul", "Joe"]
ANIMALS = [
    ("cat", "small"),
    ("dog", "brown"),
    ("bird", "tiny"),
    ("bear", "big"),
    ("fox", "red"),
    ("rabbit", "white"),
    ("mouse", "little"),
    ("duck", "yellow"),
    ("frog", "green"),
    ("owl", "wise"),
]
PLACES = [
    "a small house near the woods",
    "a big farm by the river",
    "a little town by the sea",
    "a quiet village in the hills",
    "a tall tree in the park",
    "a cozy house with a red door",
]
LIKES = [
    "play in the garden",
    "read books",
    "run in the park",
    "sing songs",
    "draw pictures",
    "look at the stars",
    "build things with blocks",
    "help his mom in the kitchen",
    "swim in the lake",
    "pick flowers",
]
TREASURES = [
    ("ball", "red"),
    ("kite", "blue"),
    ("hat", "funny"),
    ("toy car", "shiny"),
    ("teddy bear", "soft"),
    ("box", "old"),
    ("key", "golden"),
    ("drum", "loud"),
]
TRIPS = [
    ("the park", "play with friends"),
    ("the forest", "look for berries"),
    ("the beach", "build a sand castle"),
    ("the market", "buy some apples"),
    ("the hill", "fly a kite"),
    ("the lake", "watch the ducks"),
    ("the garden", "water the flowers"),
]
# (what went wrong, why it was bad, how the friends solved it): kept together
# so the solution matches the problem.
PROBLEMS = [
    (
        "it started to rain",
        "the sky was dark and the wind was cold",
        "they waited under a big tree until the rain stopped",
    ),
    ("the {t} fell into the water", "it was floating away", "they used a long stick to pull it out"),
    ("the {t} got stuck in a tree", "the branch was too high", "{f} climbed up the tree and brought it down"),
    (
        "{p} could not find the way home",
        "all the paths looked the same",
        "they followed the little river back home",
    ),
    (
        "the {t} was lost",
        "{p} looked everywhere but could not find it",
        "they looked under the bushes and found it",
    ),
    ("the {t} broke into two pieces", "it did not work any more", "they worked together and fixed it"),
]
FEELINGS_BAD = ["sad", "scared", "worried", "upset"]
FEELINGS_GOOD = ["happy", "glad", "proud", "excited"]
ASKS = ["Can you help me?", "Please help me!", "I am sad. Can you help me?", "Oh no! What can I do?"]
ANSWERS = [
    "Yes, I will help you!",
    "Don't be sad. We can fix it.",
    "Don't worry. I know what to do.",
    "Of course! That is what friends are for.",
]
MORALS = [
    "it is good to help your friends",
    "being kind makes everyone happy",
    "you should never give up",
    "friends can fix any problem together",
    "it is good to say thank you",
    "being brave is not the same as not being scared",
]
FOODS = ["apples", "bread", "cookies", "carrots", "cheese", "berries"]
HUNGRY = ["a hungry little bird", "a thin old cat", "a tired puppy", "a small mouse with no food"]
SHARE_MORALS = ["sharing makes everyone happy", "it is better to share than to keep things to yourself"]

# A few hand-written fables (my own words) for variety beyond the templates.
FABLES = """\
The Sun and the Wind
The sun and the wind once argued about who was stronger. They saw a man walking down the road in a
warm coat. "Whoever can take off his coat is the stronger one," said the wind. The wind blew and
blew, but the man only held his coat tighter. Then the sun came out and shone warm and bright. The
man was hot, so he took off his coat and sat in the shade. The wind saw that a gentle way can work
better than a hard one.

The Ant and the Bird
An ant went to the river to drink, and the water carried it away. A bird in a tree saw the ant and
dropped a leaf into the water. The ant climbed onto the leaf and floated safely to the shore. A few
days later, a hunter came to catch the bird. The ant bit his foot, and the hunter cried out. The
bird heard the noise and flew away. One good turn deserves another.

The Boy and the Jar
A boy put his hand into a jar full of nuts. He took as many as his hand could hold, but when he
tried to pull it out, the neck of the jar was too small. He did not want to let go of a single nut,
so he began to cry. His mother said, "Take only half, and your hand will come out." He did, and it
did. Do not try to do too much at once.

The Tortoise and the Hare
A hare laughed at a tortoise because he was so slow. "Let us have a race," said the tortoise. The
hare ran far ahead and then lay down for a nap. The tortoise walked and walked and never stopped.
When the hare woke up, the tortoise was already at the finish line. Slow and steady wins the race.
"""


def _a(word: str) -> str:
    """The word with its indefinite article."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def _hero(rng: random.Random) -> tuple[str, str, str]:
    """(name, pronoun, kind) of a story's main character."""
    name = rng.choice(GIRLS + BOYS)
    he = "she" if name in GIRLS else "he"
    if rng.random() < 0.5:
        return name, he, "little girl" if he == "she" else "little boy"
    animal, adj = rng.choice(ANIMALS)
    return name, he, f"{adj} {animal}"


def _opening(rng: random.Random, name: str, he: str, kind: str) -> str:
    place = rng.choice(PLACES if kind not in ("little girl", "little boy") else PLACES[:4] + PLACES[5:])
    his = "her" if he == "she" else "his"
    return rng.choice(
        [
            f"Once upon a time, there was {_a(kind)} named {name}. {he.capitalize()} lived in {place}.",
            f"Once upon a time, in {place}, there lived {_a(kind)} named {name}.",
            f"Once upon a time, there was {_a(kind)}. {his.capitalize()} name was {name}, and {he} lived in {place}.",
            f"One day, {_a(kind)} named {name} woke up early. The sun was shining.",
        ]
    )


def _problem_story(rng: random.Random) -> str:
    """Opening, a trip, a problem, a friend who helps, a moral."""
    name, he, kind = _hero(rng)
    his, him, cap = ("her", "her", "She") if he == "she" else ("his", "him", "He")
    friend = rng.choice([n for n in GIRLS + BOYS if n != name])
    f_animal, f_adj = rng.choice(ANIMALS)
    thing, t_adj = rng.choice(TREASURES)
    where, goal = rng.choice(TRIPS)
    like = rng.choice(LIKES).replace("his", his)
    problem, why, fix = (x.format(t=thing, p=name, f=friend) for x in rng.choice(PROBLEMS))
    lines = [
        _opening(rng, name, he, kind),
        f"{name} loved to {like}. {cap} had {_a(t_adj)} {thing} that {he} liked very much.",
        f"One day, {name} went to {where} to {goal}. {cap} took {his} {thing} with {him}.",
        f"But then {problem}. {name} was {rng.choice(FEELINGS_BAD)}, because {why}.",
        f'Just then, {_a(f_adj)} {f_animal} named {friend} came by. {name} said, "{rng.choice(ASKS)}"',
        f'{friend} smiled and said, "{rng.choice(ANSWERS)}"',
        f"So {fix}. {name} was very {rng.choice(FEELINGS_GOOD)}.",
        rng.choice(
            [
                f"From that day on, {name} and {friend} were best friends.",
                f'{name} said, "Thank you, {friend}!" and they went home together.',
                f"That night, {name} went to bed with a big smile.",
            ]
        ),
        f"{name} learned that {rng.choice(MORALS)}.",
    ]
    if rng.random() < 0.3:  # so the stories do not all have one shape
        del lines[1]
    return " ".join(lines)


def _sharing_story(rng: random.Random) -> str:
    """Opening, a trip to the market, someone hungry, sharing."""
    name, he, kind = _hero(rng)
    cap = he.capitalize()
    food = rng.choice(FOODS)
    hungry = rng.choice(HUNGRY)
    mom = rng.choice(["mom", "dad", "grandma", "big brother", "big sister"])
    his = "her" if he == "she" else "his"
    return " ".join(
        [
            _opening(rng, name, he, kind),
            f"One morning, {name} and {his} {mom} went to the market. They bought some {food} and some milk.",
            f"On the way home, {name} saw {hungry} sitting by the road. It looked at the {food}.",
            f'"Can I give it some of my {food}?" asked {name}. "Yes, you can," said {his} {mom}.',
            f"{cap} gave some {food} to it, and it ate them all up. Then it was not hungry any more.",
            f"{name} felt warm inside. {cap} learned that {rng.choice(SHARE_MORALS)}.",
        ]
    )


def make_corpus(n_stories: int = 420, seed: int = SEED) -> str:
    """~250 KB: template stories separated by blank lines, plus the fables."""
    rng = random.Random(seed)
    stories = [_problem_story(rng) if rng.random() < 0.75 else _sharing_story(rng) for _ in range(n_stories)]
    # Source lines are wrapped for reading; a fable is its title line plus one paragraph.
    fables = [title + "\n" + " ".join(rest) for title, *rest in (f.split("\n") for f in FABLES.strip().split("\n\n"))]
    # The fables are repeated so they are not drowned by the template stories.
    stories += fables * 4
    rng.shuffle(stories)
    return "\n\n".join(stories) + "\n"


# ---------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(corpus: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.split("\n\n"), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} ids, want {VOCAB_SIZE}")
    # Plain encode() prepends <s>, like Llama/Mistral; the chat template writes it itself.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------
# Training


def token_stream(tok: Tokenizer, corpus: str) -> torch.Tensor:
    """All documents as <s> doc </s> <s> doc </s> ..., one long 1-D tensor."""
    ids: list[int] = []
    for doc in corpus.split("\n\n"):
        ids += tok.encode(doc.strip()).ids + [EOS_ID]
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, steps: int, lr: float = LR, warmup: int = WARMUP) -> float:
    """Linear warm-up, then a cosine down to a tenth (the demo's schedule; its draft and MTP layer take it too)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def held_out(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams: the last 5% held out, to see a model is not just memorising."""
    n_val = len(data) // 20
    return data[:-n_val], data[-n_val:]


def fit(params: list, loss_of, train_ids: torch.Tensor, steps: int, lr: float, warmup: int) -> float:
    """AdamW over `params` on seeded random batches of the stream, `loss_of(x [BATCH, SEQ_LEN])` a batch's loss
    (tools/make_draft_model.py, tools/make_demo_mtp.py); the train loss's EMA at the end."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(SEED)
    t0, ema = time.time(), float("nan")
    for step in range(steps):
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (BATCH,), generator=gen)
        x = torch.stack([train_ids[s : s + SEQ_LEN] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = loss_of(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  (ema {ema:.3f})  {time.time() - t0:.0f}s", flush=True)
    return ema


def tool_args(doc: str, out: Path, steps: int, extra=None) -> argparse.Namespace:
    """--out, --steps, --threads (and `extra(parser)`'s) of the tools that train the demo's pieces; torch set to
    the threads. One thread by default: results depend on the thread count, and on a busy machine OpenMP
    spin-waiting made 2 threads cost 20x the CPU time per step (5.5 s vs 0.28 s measured here)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--threads", type=int, default=1)
    if extra is not None:
        extra(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    return a


@torch.no_grad()
def greedy(model: MixtralForCausalLM, tok: Tokenizer, prompt: str, n: int) -> str:
    model.eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.train()
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def train(tok: Tokenizer, corpus: str, steps: int) -> tuple[MixtralForCausalLM, float]:
    data = token_stream(tok, corpus)
    train_ids, val_ids = held_out(data)
    print(f"corpus {len(corpus) / 1024:.0f} KB, {len(data)} tokens ({len(corpus) / len(data):.2f} chars/token)")

    torch.manual_seed(SEED)
    config = MixtralConfig(**MODEL)
    model = MixtralForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    t0, c0 = time.time(), time.process_time()
    ema = float("nan")
    for step in range(steps):
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (BATCH,), generator=gen)
        x = torch.stack([train_ids[s : s + SEQ_LEN] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm = (out.loss - config.router_aux_loss_coef * out.aux_loss).item()
        ema = lm if math.isnan(ema) else 0.95 * ema + 0.05 * lm
        if step % 100 == 0 or step == steps - 1:
            print(
                f"step {step:5d}  loss {lm:.3f}  (ema {ema:.3f})  aux {out.aux_loss.item():.3f}  "
                f"lr {lr_at(step, steps):.2e}  {time.time() - t0:.0f}s ({time.process_time() - c0:.0f}s cpu)",
                flush=True,
            )
    val = evaluate(model, val_ids)
    print(
        f"done in {time.time() - t0:.0f}s ({time.process_time() - c0:.0f}s cpu): "
        f"train loss (ema) {ema:.3f}, held-out loss {val:.3f}"
    )
    return model, val


@torch.no_grad()
def evaluate(model: MixtralForCausalLM, ids: torch.Tensor) -> float:
    model.eval()
    n = (len(ids) - 1) // SEQ_LEN
    x = ids[: n * SEQ_LEN].reshape(n, SEQ_LEN)
    loss = model(input_ids=x, labels=x).loss.item()
    model.train()
    return loss


def main() -> None:
    a = tool_args(__doc__, DEFAULT_OUT, STEPS, lambda ap: ap.add_argument(
        "--dump-corpus", type=Path, help="write the generated corpus here and exit"))
    corpus = make_corpus()
    if a.dump_corpus:
        a.dump_corpus.write_text(corpus, encoding="utf-8")
        return
    tok = train_tokenizer(corpus)
    model, _ = train(tok, corpus, a.steps)

    for prompt in ["Once upon a time", "One day, Tom went to", "The sun and the wind"]:
        print(f"greedy> {greedy(model, tok, prompt, 60)!r}")

    model.config.output_router_logits = False  # a training-only switch
    save(model, tok, a.out)


def save(model, tok: Tokenizer, out: Path) -> None:
    """The model in bf16 (the hub layout) and the tokenizer files into `out`, emptied first (a stale shard from an
    older run would be loaded too); tools/make_draft_model.py saves its draft the same way."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    write_tokenizer(tok, out)
    total = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({total / 2**20:.2f} MiB): {', '.join(sorted(f.name for f in out.iterdir()))}")


if __name__ == "__main__":
    main()
