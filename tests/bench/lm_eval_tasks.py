"""Local lm-eval tasks written by the tests (nothing downloads): a multiple-choice arithmetic task of
number words, the same questions in MMLU's format (lettered options, one-token answers " A".." D",
few-shot examples from a dev split, the same first ones for every question: lm-eval's MMLU
`fewshot_config`) and a short-answer generate_until task, as jsonl files with lm-eval YAMLs
(`dataset_path: json`, local `data_files`)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def mc_docs(count: int = 48) -> list[dict]:
    """`count` questions "Tom has a apples and gets b more..." with four choices "N apples" (two tokens or more
    each: no two choices of a question share an input, so shared contexts are what prefix reuse saves), the
    right one at a varying place."""
    docs = []
    for i in range(count):
        a, b = i % 7 + 1, (i * 5) % 9 + 1
        right = a + b
        wrong = [w for w in (right + 1, right - 1, right + 3, right - 2) if 0 <= w < len(WORDS) and w != right][:3]
        choices = [WORDS[w] for w in wrong]
        choices.insert(i % 4, WORDS[right])
        docs.append({"question": f"Tom has {WORDS[a]} apples and gets {WORDS[b]} more. How many apples does he have?",
                     "choices": [f" {c} apples" for c in choices], "answer": i % 4})
    return docs


def gen_docs(count: int = 12) -> list[dict]:
    """Short questions answered in a few words (greedy outputs are compared, not graded)."""
    return [{"question": f"Name a colour that is not {c}.", "target": "red"}
            for c in ("red", "blue", "green", "white", "black", "yellow", "pink", "purple", "orange", "brown",
                      "grey", "gold")][:count]


MC_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GEN_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: target
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
"""


MMLU_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
    dev: {dev}
test_split: test
fewshot_split: dev
fewshot_config:
  sampler: first_n
output_type: multiple_choice
description: "The following are multiple choice questions (with answers) about arithmetic.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
"""


def mmlu_docs(count: int, offset: int = 0) -> list[dict]:
    """mc_docs' questions (from question `offset` on) with bare options ("seven apples") for MMLU_YAML."""
    docs = mc_docs(count + offset)[offset:]
    return [dict(d, choices=[c.strip() for c in d["choices"]]) for d in docs]


def write_tasks(directory: Path, mc_count: int = 48, gen_count: int = 12, max_gen_toks: int = 12,
                mmlu_count: int = 0) -> Path:
    """directory/tasks: bestiary_mc and bestiary_gen (YAML + jsonl), and with mmlu_count > 0 bestiary_mmlu
    (mmlu_count test questions, 8 dev ones for the few-shot examples); returns the folder for --include_path."""
    tasks = directory / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    for name, docs, yaml in (("bestiary_mc", mc_docs(mc_count), MC_YAML), ("bestiary_gen", gen_docs(gen_count), GEN_YAML)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(yaml.format(name=name, data=data, max_gen_toks=max_gen_toks))
    if mmlu_count:
        data, dev = tasks / "bestiary_mmlu.jsonl", tasks / "bestiary_mmlu_dev.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in mmlu_docs(mmlu_count, offset=8)))
        dev.write_text("".join(json.dumps(d) + "\n" for d in mmlu_docs(8)))
        (tasks / "bestiary_mmlu.yaml").write_text(MMLU_YAML.format(name="bestiary_mmlu", data=data, dev=dev))
    return tasks


def read_samples(output: Path, task: str) -> list[dict]:
    """The --log_samples records of `task` under an lm-eval --output_path folder, in doc order."""
    files = sorted(output.rglob(f"samples_{task}_*.jsonl"))
    assert files, f"no samples of {task} under {output}"
    rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["doc_id"])


def read_results(output: Path) -> dict:
    files = sorted(output.rglob("results_*.json"))
    assert files, f"no results under {output}"
    return json.loads(files[-1].read_text())["results"]
