"""Reward functions: 1.0 when a completion's final answer equals the gold answer, else 0.0.

:func:`numeric_reward` checks numbers (``arith``, ``gsm8k``, ``aime``, ``amc``);
:func:`math_reward` checks LaTeX answers with math-verify (``math``). Neither ever raises:
unreadable completions score 0. math-verify's per-completion warnings (timeouts on
pathological LaTeX) are silenced: they would flood run logs.
"""
from __future__ import annotations

import functools
import logging
import math
import re
import threading
from fractions import Fraction

_NUMBER = r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?")
_LEADING_RE = re.compile(rf"\s*\\?\$?\s*({_NUMBER_RE.pattern})")
_EXPRESSION_NEXT_RE = re.compile(r"[ \t]*[=+\-*/×^%A-Za-z]")
_HASHES_RE = re.compile(rf"####\s*\\?\$?\s*({_NUMBER_RE.pattern})")
_ANSWER_IS_RE = re.compile(r"answer is\s*:?\s*", re.IGNORECASE)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{[^{}]*\}")
_LATEX_NOISE_RE = re.compile(r"\\[,;!: ]|\\\$|\$|\\%|%|\\left|\\right|\^\s*\{?\\circ\}?")
_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)(?![A-Za-z])(\s*)")
_TIMEOUT_S = 2
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _balanced(text: str, start: int):
    """The content of the ``{...}`` group opening at ``text[start]`` (None if unclosed)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def last_boxed(text: str):
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (nested braces kept), or None.

    ``\\boxed 5`` (no braces) gives ``'5'``.
    """
    for match in reversed(list(_BOX_RE.finditer(text))):
        if text.startswith("{", match.end()):
            content = _balanced(text, match.end())
            if content is not None:
                return content
        elif match.group(1):
            token = re.match(r"[^\s$.,]+", text[match.end():])
            if token:
                return token.group()
    return None


def gsm8k_gold(answer_text: str) -> str:
    """The final answer of a GSM8K worked solution: the text after ``####``, commas removed."""
    return answer_text.rsplit("####", 1)[-1].strip().replace(",", "")


def _answer_is(text: str):
    """The rest of the line after the first "the answer is[:]", trailing '.' and '$' removed."""
    match = _ANSWER_IS_RE.search(text)
    if match is None:
        return None
    line = text[match.end():].split("\n", 1)[0].strip()
    line = re.sub(r"[\s.$]+$", "", line)
    return line or None


def _to_number(text: str):
    """``text`` as a Fraction if it is one number ('1,000', '$5', '0.5', '1/2', '\\frac{1}{2}')."""
    text = _FRAC_RE.sub(r"(\1)/(\2)", _TEXT_RE.sub("", text))
    text = _LATEX_NOISE_RE.sub("", text).replace("(", "").replace(")", "").strip().rstrip(".")
    if not _NUMBER_RE.fullmatch(text):
        return None
    try:
        parts = [Fraction(p.replace(",", "").strip()) for p in text.split("/")]
        return parts[0] / parts[1] if len(parts) == 2 else parts[0]
    except (ValueError, ZeroDivisionError):
        return None


def _numeric_answer(text: str):
    """The number a completion gives as its final answer, or None (see :func:`numeric_reward`)."""
    boxed = last_boxed(text)
    if boxed is not None:
        value = _to_number(boxed)
        if value is None:
            number = _NUMBER_RE.search(boxed)
            value = _to_number(number.group()) if number else None
        return value
    hashes = _HASHES_RE.search(text)
    if hashes:
        return _to_number(hashes.group(1))
    stated = _answer_is(text)
    if stated is not None:
        number = _NUMBER_RE.search(stated)
        return _to_number(number.group()) if number else None
    leading = _LEADING_RE.match(text)
    if leading and not _EXPRESSION_NEXT_RE.match(text, leading.end()):
        return _to_number(leading.group(1))
    numbers = _NUMBER_RE.findall(text)
    return _to_number(numbers[-1]) if numbers else None


def _close(a: Fraction, b: Fraction) -> bool:
    """Integers must match exactly; otherwise a relative tolerance of 1e-6 ('0.3333333' ~ 1/3)."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)


def numeric_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final number equals the numeric ``gold`` (see :func:`_close`).

    The final answer is the last ``\\boxed{}``, else the first ``#### n``, else the first
    "the answer is n", else a number opening the completion (the ``arith`` form ``'85'`` or
    ``' 85\\n...'``, unless an operator, '=' or a word follows it), else the last number.
    Commas, '$', a trailing '.', decimals and fractions are understood.
    """
    try:
        want = _to_number(str(gold))
        got = _numeric_answer(str(completion))
        return float(want is not None and got is not None and _close(got, want))
    except Exception:
        return 0.0


def _math_answer(text: str):
    boxed = last_boxed(text)
    return boxed if boxed is not None else _answer_is(text)


def _normalized(latex: str) -> str:
    latex = re.sub(r"\\[dt]frac", r"\\frac", _LATEX_NOISE_RE.sub("", latex))
    return re.sub(r"\s+", "", latex).rstrip(".")


@functools.lru_cache(maxsize=4096)
def _parsed(latex: str, limit):
    """math-verify's reading of the answer ``latex`` (empty when unreadable or timed out)."""
    from math_verify import parse  # here: math-verify loads sympy, which arith jobs never need

    return parse(f"\\boxed{{{latex}}}", parsing_timeout=limit)


def _verify(gold: str, answer: str) -> bool:
    """math-verify equivalence, with its signal timeouts where signals work (main thread)."""
    from math_verify import verify  # here: see _parsed

    limit = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed, answer_parsed = _parsed(gold, limit), _parsed(answer, limit)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=limit))


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to the LaTeX ``gold``.

    The final answer is the last ``\\boxed{...}``/``\\fbox{...}`` (balanced braces), else the
    text after "The answer is:". Plain numbers compare numerically; everything else goes
    through math-verify (timeouts and errors count as wrong).
    """
    from math_verify.errors import TimeoutException  # here: see _parsed

    try:
        gold = str(gold)
        gold = last_boxed(gold) or gold
        answer = _math_answer(str(completion))
        if answer is None or not answer.strip():
            return 0.0
        if _normalized(answer) == _normalized(gold):
            return 1.0
        want, got = _to_number(gold), _to_number(answer)
        if want is not None and got is not None:
            return float(_close(got, want))
        return float(_verify(gold, answer))
    except (Exception, TimeoutException):
        return 0.0
