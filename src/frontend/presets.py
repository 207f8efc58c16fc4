"""Scoring presets: how a (query, document) pair becomes token ids, and which labels score it.

A preset is chosen by the `model` name of a rerank / score request (GET /v1/models lists them)
and defined in the model repository beside the model's config (scoring_presets.json):

    "qwen3-reranker": {"template": "<|im_start|>system\\n...<Query>: {query}\\n<Document>: {document}<|im_end|>...",
                       "labels": ["yes", "no"], "default_instruction": "Given a web search query, ..."}

`template` holds `{query}` and `{document}` once each (query first) and optionally
`{instruction}` before the document; only those literal placeholders are replaced (no format
specs: a document's braces stay text). `labels[0]` is the relevant answer: a document's relevance
is P(labels[0]) renormalised over the labels. Every label must be one token of the loaded
tokenizer, checked when the presets are loaded (ConfigError naming it otherwise).

Rendering splits the template at `{document}`: the part before it (system turn, instruction,
query) is the shared prompt of one multi-item request, computed once for all documents and
kept in the prefix cache; each document + the rest of the template is an item. One space that
ends the shared part moves to the document, because byte-level BPE tokenizers attach a space
to the word after it: the ids then equal those of the whole text tokenized at once (checked
against the published Qwen3-Reranker construction in tests/frontend/test_frontend_presets.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..contract.errors import ConfigError, InvalidRequestError
from ..contract.token_texts import TokenTexts

PRESETS_FILE = "scoring_presets.json"
QUERY, DOCUMENT, INSTRUCTION = "{query}", "{document}", "{instruction}"
_PLACEHOLDER = re.compile(r"\{query\}|\{instruction\}")


@dataclass(frozen=True)
class Rendered:
    """One query's token ids: the shared prompt and one item per document."""
    shared: list[int]
    items: list[list[int]]
    truncated: list[int]  # indices of the documents that were cut to fit


@dataclass(frozen=True)
class ScoringPreset:
    name: str
    template: str
    labels: tuple[str, ...]
    label_ids: tuple[int, ...]
    default_instruction: str = ""
    description: str = ""

    @property
    def raw(self) -> bool:
        """The template is the bare concatenation: token-id queries and items can use it."""
        return self.template == QUERY + DOCUMENT

    def split(self, query: str, instruction: str | None = None) -> tuple[str, str, str]:
        """(shared text, what precedes each document in its item, what follows it)."""
        head, tail = self.template.split(DOCUMENT, 1)
        instruction = self.default_instruction if instruction is None else instruction
        # one pass, so that a query holding "{instruction}" (or the reverse) stays text
        values = {QUERY: query, INSTRUCTION: instruction}
        head = _PLACEHOLDER.sub(lambda m: values[m.group(0)], head)
        lead = ""
        if head.endswith(" "):  # the word after a space carries it in byte-level BPE
            head, lead = head[:-1], " "
        return head, lead, tail


class TemplateTokenizer:
    """The preset rendering over one tokenizer: the frontend's (contract/tokenizer_file.py), or a
    transformers one (the same methods: encode, a batch call, decode, eos_token_id)."""

    def __init__(self, tokenizer, max_input_len: int):
        self.tokenizer = tokenizer
        self.max_input_len = max_input_len
        self._texts = TokenTexts(tokenizer)

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        """Ids of `text`; special tokens of the model (BOS) only at the start of a prompt."""
        return list(self.tokenizer.encode(text, add_special_tokens=first))

    def split_joined(self, query: str, items: list[str]) -> tuple[list[int], list[list[int]]]:
        """SGLang's scoring tokenization: each query + item tokenized as one string, then split
        into the ids all of them share with the query's own (the multi-item request's shared
        prompt, computed once) and each item's rest; every item keeps at least one id."""
        query_ids = self.encode(query, first=True)
        joined = [self.encode(query + item, first=True) for item in items]
        shared = len(query_ids)
        for ids in joined:
            common = next((i for i, (a, b) in enumerate(zip(query_ids, ids)) if a != b), min(len(query_ids), len(ids)))
            shared = min(shared, common, len(ids) - 1)
        return query_ids[:shared], [ids[shared:] for ids in joined]

    def token_text(self, token_id: int) -> str:
        """One token's text, as the engine decodes it (contract/token_texts.py)."""
        return self._texts(token_id)

    def single_token(self, label: str) -> int | None:
        ids = self.encode(label)
        return ids[0] if len(ids) == 1 else None

    def render(self, preset: ScoringPreset, query: str, documents: list[str], *, instruction: str | None = None,
               max_tokens_per_doc: int | None = None, truncate: str | None = None) -> Rendered:
        """The shared prompt and items of `documents` under `preset`. A document longer than
        `max_tokens_per_doc` tokens is cut to it; one that still does not fit the model's input
        length with the shared prompt is cut from the `truncate` side ("right" or "left") when
        given, else refused naming its index."""
        head, lead, tail = preset.split(query, instruction)
        shared = self.encode(head, first=True) if head else []
        if not shared:
            raise InvalidRequestError("query is empty and the template adds nothing before the document: "
                                      "the shared prompt would have no tokens")
        tail_ids = self.encode(tail) if tail else []
        room = self.max_input_len - len(shared) - len(tail_ids)
        if room < 1:
            raise InvalidRequestError(f"query: the query and the template take {len(shared) + len(tail_ids)} tokens, "
                                      f"leaving no room for a document within the model's {self.max_input_len}")
        items, truncated = [], []
        ids_of = self.tokenizer(list(lead + d for d in documents), add_special_tokens=False)["input_ids"] if documents else []
        for i, doc_ids in enumerate(ids_of):
            doc_ids = list(doc_ids)
            if max_tokens_per_doc is not None and len(doc_ids) > max_tokens_per_doc:
                doc_ids, cut = doc_ids[:max_tokens_per_doc], True
            else:
                cut = False
            if len(doc_ids) > room:
                if truncate is None:
                    raise InvalidRequestError(
                        f"documents[{i}] has {len(doc_ids)} tokens; with the query and the template it is over the "
                        f"model's input length of {self.max_input_len} tokens (room for {room}); shorten it or ask for truncation")
                doc_ids, cut = (doc_ids[:room] if truncate == "right" else doc_ids[len(doc_ids) - room:]), True
            item = doc_ids + tail_ids
            if not item:
                raise InvalidRequestError(f"documents[{i}] is empty, and the template adds nothing after it: nothing to score")
            items.append(item)
            if cut:
                truncated.append(i)
        return Rendered(shared=shared, items=items, truncated=truncated)


def load_presets(path: str | Path, tokenizer: TemplateTokenizer) -> dict[str, ScoringPreset]:
    """The presets of `path` (a scoring_presets.json), each checked against the tokenizer:
    ConfigError naming the preset and the problem (a label that is not one token, a template
    without its placeholders)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the scoring presets {path}: {e}") from e
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{path}: expected an object of presets by name")
    out = {}
    for name, spec in data.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"{path}: preset {name!r} must be an object")
        unknown = set(spec) - {"template", "labels", "default_instruction", "description"}
        if unknown:
            raise ConfigError(f"{path}: preset {name!r} has unknown field(s) {', '.join(sorted(unknown))}")
        template, labels = spec.get("template"), spec.get("labels")
        if not isinstance(template, str) or template.count(QUERY) != 1 or template.count(DOCUMENT) != 1 \
                or template.index(QUERY) > template.index(DOCUMENT) \
                or template.count(INSTRUCTION) > 1 or INSTRUCTION in template.split(DOCUMENT, 1)[1]:
            raise ConfigError(f"{path}: preset {name!r}: template must hold {QUERY} and then {DOCUMENT} once each "
                              f"(and at most one {INSTRUCTION} before the document)")
        if not isinstance(labels, list) or len(labels) < 2 or not all(isinstance(x, str) for x in labels):
            raise ConfigError(f"{path}: preset {name!r}: labels must be a list of at least two strings, the relevant one first")
        ids = []
        for label in labels:
            token = tokenizer.single_token(label)
            if token is None:
                pieces = tokenizer.encode(label)
                raise ConfigError(f"scoring preset {name!r}: label {label!r} is not one token of the loaded tokenizer "
                                  f"(it encodes to {len(pieces)} tokens {pieces}); presets need single-token labels")
            ids.append(token)
        if len(set(ids)) != len(ids):
            raise ConfigError(f"scoring preset {name!r}: labels {labels} are not distinct tokens")
        out[name] = ScoringPreset(name=name, template=template, labels=tuple(labels), label_ids=tuple(ids),
                                  default_instruction=str(spec.get("default_instruction", "")),
                                  description=str(spec.get("description", "")))
    return out
