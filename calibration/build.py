"""Assemble calibration/train.jsonl and calibration/heldout.jsonl (deterministic; see README.md).

    python calibration/build.py

Sources: our own prose (src/prose_en.txt, src/prose_zh.txt), math word problems and chat turns
generated here from our own templates, and Python standard library modules (PSF licence) copied
from the local Python install (the copies are kept in src/stdlib/ so the build does not depend on
the Python version). One long document (statistics.py, whole) is in train. Every 10th document (after a seeded shuffle) goes to the held-out split.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
STDLIB_FILES = ["textwrap.py", "shlex.py", "fractions.py", "heapq.py", "bisect.py", "colorsys.py",
                "graphlib.py", "string.py", "calendar.py"]
LONG_FILE = "statistics.py"  # kept whole: the long document
CHUNK = 3000  # code is cut into ~3 KB documents at blank lines

NAMES_EN = ["Alice", "Ben", "Chen", "Dana", "Emil", "Fatima", "George", "Hana", "Ivan", "Julia", "Kofi", "Lena"]
NAMES_ZH = ["小明", "小红", "李华", "王芳", "张伟", "刘洋", "陈静", "赵磊"]
ITEMS_EN = [("apples", "apple"), ("pencils", "pencil"), ("books", "book"), ("stickers", "sticker"),
            ("marbles", "marble"), ("cookies", "cookie"), ("stamps", "stamp"), ("shells", "shell")]
ITEMS_ZH = ["苹果", "铅笔", "本书", "张贴纸", "颗弹珠", "块饼干", "张邮票", "个贝壳"]


def math_en(r: random.Random) -> str:
    n = r.choice(NAMES_EN)
    m = r.choice([x for x in NAMES_EN if x != n])
    items, item = r.choice(ITEMS_EN)
    kind = r.randrange(5)
    if kind == 0:
        a, b = r.randint(5, 60), r.randint(2, 40)
        return (f"Question: {n} has {a} {items}. {m} gives {n} {b} more {items}. How many {items} does {n} have now?\n"
                f"Answer: {n} starts with {a} {items} and receives {b}, so {a} + {b} = {a + b}. The answer is {a + b}.")
    if kind == 1:
        a = r.randint(20, 90)
        b = r.randint(1, a - 1)
        return (f"Question: {n} had {a} {items} and gave {b} of them to {m}. How many {items} are left?\n"
                f"Answer: {a} - {b} = {a - b}. {n} has {a - b} {items} left.")
    if kind == 2:
        a, p = r.randint(2, 12), r.randint(2, 15)
        return (f"Question: One {item} costs {p} dollars. {n} buys {a} {items}. How much does {n} pay?\n"
                f"Answer: {a} x {p} = {a * p}. {n} pays {a * p} dollars.")
    if kind == 3:
        k, q = r.randint(2, 9), r.randint(2, 12)
        return (f"Question: {n} shares {k * q} {items} equally among {k} friends. How many {items} does each friend get?\n"
                f"Answer: {k * q} / {k} = {q}. Each friend gets {q} {items}.")
    s, t = r.randint(30, 90), r.randint(2, 6)
    return (f"Question: A train travels at {s} kilometres per hour for {t} hours. How far does it go?\n"
            f"Answer: distance = speed x time = {s} x {t} = {s * t} kilometres.")


def math_zh(r: random.Random) -> str:
    n = r.choice(NAMES_ZH)
    m = r.choice([x for x in NAMES_ZH if x != n])
    item = r.choice(ITEMS_ZH)
    kind = r.randrange(4)
    if kind == 0:
        a, b = r.randint(5, 60), r.randint(2, 40)
        return f"问题：{n}有{a}个{item}，{m}又给了{n}{b}个。{n}现在有多少个？\n解答：{a} + {b} = {a + b}，所以{n}现在有{a + b}个。"
    if kind == 1:
        a = r.randint(20, 90)
        b = r.randint(1, a - 1)
        return f"问题：{n}有{a}个{item}，送给{m}{b}个，还剩多少个？\n解答：{a} - {b} = {a - b}，还剩{a - b}个。"
    if kind == 2:
        a, p = r.randint(2, 12), r.randint(2, 15)
        return f"问题：每个{item}{p}元，{n}买了{a}个，一共要付多少钱？\n解答：{a} × {p} = {a * p}，一共{a * p}元。"
    k, q = r.randint(2, 9), r.randint(2, 12)
    return f"问题：{n}把{k * q}个{item}平均分给{k}个同学，每人分到几个？\n解答：{k * q} ÷ {k} = {q}，每人分到{q}个。"


def chat(r: random.Random) -> str:
    topics = [
        ("How do I reverse a list in Python?", "Use `items.reverse()` to reverse in place, or `items[::-1]` to get a new list."),
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Can you explain what a hash table is?", "A hash table stores key-value pairs in an array and uses a hash function "
         "to turn each key into an index, so lookups take constant time on average."),
        ("怎么用 Python 读取一个文件？", "可以用 `with open(path, encoding=\"utf-8\") as f: text = f.read()`，这样文件会自动关闭。"),
        ("今天天气怎么样？", "我无法获取实时天气，建议你查看本地的天气预报。"),
        ("What does perplexity measure?", "Perplexity is the exponential of the average negative log-likelihood per token: "
         "lower means the model predicts the text better."),
        ("Write a function that adds two numbers.", "```python\ndef add(a, b):\n    return a + b\n```"),
        ("什么是量化？", "量化是把高精度的数值映射到较少的离散等级上，用来减少模型的存储和计算开销。"),
    ]
    turns = r.sample(topics, 3)
    out = ["<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"]
    for q, a in turns:
        out.append(f"<|im_user|>user<|im_middle|>{q}<|im_end|>")
        out.append(f"<|im_assistant|>assistant<|im_middle|>{a}<|im_end|>")
    return "\n".join(out)


def code_chunks(text: str, size: int = CHUNK) -> list[str]:
    out, cur = [], []
    n = 0
    for block in text.split("\n\n"):
        cur.append(block)
        n += len(block) + 2
        if n >= size:
            out.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        out.append("\n\n".join(cur))
    return out


def stdlib_copy(name: str) -> str:
    dst = SRC / "stdlib" / name
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text((Path(sysconfig.get_paths()["stdlib"]) / name).read_text())
    return dst.read_text()


def documents() -> list[dict]:
    r = random.Random(1234)
    docs: list[dict] = []
    for lang in ("en", "zh"):
        for para in (SRC / f"prose_{lang}.txt").read_text().split("\n\n"):
            if para.strip():
                docs.append({"text": para.strip(), "source": f"prose_{lang}"})
    for _ in range(700):
        docs.append({"text": math_en(r), "source": "math_en"})
    for _ in range(400):
        docs.append({"text": math_zh(r), "source": "math_zh"})
    for _ in range(120):
        docs.append({"text": chat(r), "source": "chat"})
    for name in STDLIB_FILES:
        for c in code_chunks(stdlib_copy(name)):
            docs.append({"text": c, "source": f"python-stdlib/{name}"})
    return docs


def main() -> None:
    docs = documents()
    r = random.Random(42)
    r.shuffle(docs)
    train = [d for i, d in enumerate(docs) if i % 10]
    held = [d for i, d in enumerate(docs) if i % 10 == 0]
    # templated documents can repeat: keep the held-out split disjoint from train (and free of repeats)
    seen = {d["text"] for d in train}
    held_unique = []
    for d in held:
        if d["text"] not in seen:
            seen.add(d["text"])
            held_unique.append(d)
    held = held_unique
    # the long document (a whole stdlib module, ~48 KB) is kept whole in the train split
    train.append({"text": stdlib_copy(LONG_FILE), "source": f"python-stdlib/{LONG_FILE} (long)"})
    for name, split in (("train.jsonl", train), ("heldout.jsonl", held)):
        with open(HERE / name, "w", encoding="utf-8") as f:
            for d in split:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        print(f"{name}: {len(split)} documents, {sum(len(d['text']) for d in split)} characters")


if __name__ == "__main__":
    main()
