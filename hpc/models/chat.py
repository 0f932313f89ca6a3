"""Chat templates: which tokens end a completion, and a model folder's tokenizer for chat prompts.

A completion ends at the tokenizer's EOS or at the end-of-turn token its chat template writes
after an assistant message (``<|im_end|>`` for Qwen, ``<|eot_id|>`` for Llama 3). The end-of-turn
token is read off the template itself: an assistant message is rendered and the first special
token after its content is taken.
"""
from __future__ import annotations

from transformers import AutoTokenizer

from hpc.models.folders import check_model_folder
from hpc.models.loading import model_folder
from hpc.runtime.errors import UserError

_PROBE = "hpc-end-of-turn-probe"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant message's content,
    or None (no template, nothing special after the content, or a template that refuses the
    probe conversation)."""
    if not has_chat_template(tokenizer):
        return None
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - templates raise anything (jinja errors, raise_exception)
        return None
    tail = text.rpartition(_PROBE)[2] if _PROBE in text else ""
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return ids[0] if ids and ids[0] in special else None


def stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS and the chat template's end-of-turn
    token (sorted, no duplicates; empty if the tokenizer has neither)."""
    ids = {tokenizer.eos_token_id, end_of_turn_id(tokenizer)}
    ids.discard(None)
    return sorted(ids)


def chat_tokenizer(path: str, fmt_name: str):
    """The tokenizer of the model folder (or built-in model) ``path``, which must have a chat
    template: UserError naming the folder and ``task.prompt_format`` otherwise. Reads only
    tokenizer files (no weights)."""
    folder = model_folder(path)
    check_model_folder(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - any loader failure is a bad model folder
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"cannot load the tokenizer in {folder}: {first}") from None
    if not has_chat_template(tokenizer):
        raise UserError(f"model folder {folder} has no chat template, which "
                        f"task.prompt_format={fmt_name} needs (use task.prompt_format=plain)")
    return tokenizer
