"""Reward functions: 1.0 when a completion's final answer equals the gold answer, else 0.0.

:func:`numeric_reward` checks numbers (``arith``, ``gsm8k``, ``aime``, ``amc``);
:func:`math_reward` checks LaTeX answers with math-verify (``math``). Neither ever raises:
unreadable completions score 0. math-verify's per-completion warnings (timeouts on
pathological LaTeX) are silenced: they would flood run logs.

The final answer is what the LAST final-answer marker gives: ``\\boxed{...}``, "the answer
is ...", and (numeric only) ``#### ...``; a marker with nothing after it ("The answer is .")
is an empty answer and scores 0. Both graders read a value with :func:`to_number`: plain
numbers, '1,000', '$5', '50%', '1/2', scientific notation ('4.5e33', '4.5E33'), a leading
minus written '\u2212' or '- 3', a leading plus ('+2'), trailing units ('5 dollars',
'9 (apples)', '12 (star-shaped stones)', '5 (km/h)', '18 \\text{ cm}'),
and through math-verify the LaTeX forms ``\\frac{1}{2}``, ``\\frac12``, ``2^{10}``,
``4.5 \\times 10^{33}`` and ``4.5 \\cdot 10^{33}``.
"""
from __future__ import annotations

import functools
import logging
import re
import threading
from fractions import Fraction

_MINUS = "\u2212"  # Unicode minus sign, read as '-'
_DIGITS = (r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
           r"(?:[eE][-+]?\d{1,3}(?![\w.]))?")  # exponents of at most 3 digits: bounded work
_SIGN = rf"(?:(?<![\w)}}])[-{_MINUS}])?"  # '5-3' is a difference, not 5 and -3
_NUMBER = _SIGN + _DIGITS
_PLAIN = rf"(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?"  # '3', '-1,000.5', '4.5e33', '1/2'
_POWER = r"\s*\^\s*(?:\{\s*[-+]?\d{1,3}\s*\}|\d)"  # '^{10}', '^2'
_FRAC_ARG = rf"(?:\{{\s*[-{_MINUS}]?{_DIGITS}\s*\}}|\d)"
_LATEX = (rf"(?:{_SIGN}\\[dt]?frac\s*{_FRAC_ARG}\s*{_FRAC_ARG}"  # \frac{1}{2}, \frac12
          rf"|{_NUMBER}\s*(?:\\times|\\cdot|×|·)\s*10{_POWER}"  # 4.5 \times 10^{33}
          rf"|{_NUMBER}{_POWER})")  # 2^{10}
_PLAIN_RE = re.compile(_PLAIN)
_LATEX_RE = re.compile(_LATEX)
_VALUE_RE = re.compile(rf"{_LATEX}|{_PLAIN}")
_LEADING_RE = re.compile(rf"\s*(?:\\?\$\s*)?({_VALUE_RE.pattern})")  # one \s* run: linear
_EXPRESSION_NEXT_RE = re.compile(r"[ \t]*[=+\-*/×^%A-Za-z]")
_MARKER_RE = re.compile(r"answer is\s*:?|####", re.IGNORECASE)
# "... so our answer is correct." checks an answer given before; it states none
_VERDICT_RE = re.compile(r"(?:correct|right|wrong|incorrect|indeed|consistent|verified|"
                         r"confirmed|reasonable|valid)\b", re.IGNORECASE)
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{[^{}]*\}")
_LATEX_NOISE_RE = re.compile(r"\\[,;!: ]|\\\$|\$|\\%|%|\\left|\\right|\^\s*\{?\\circ\}?")
# Trailing units: '9 (apples)', '12 (star-shaped stones)', '5 (km/h)', '5 dollars',
# '18 square feet', '3 two-digit numbers'; starting with a word of 2+ letters, not 'pi'.
_WORD = r"[A-Za-z]+(?:-[A-Za-z]+)*"  # 'star-shaped'
_UNITS_RE = re.compile(rf"\s*(?:\(\s*(?!pi\b)[A-Za-z]{{2,}}[-A-Za-z ./]*\)"
                       rf"|(?<=[\d\s])(?!pi\b)[A-Za-z]{{2,}}(?:-[A-Za-z]+)*(?:\s+{_WORD})*)\s*$")
_PLUS_RE = re.compile(r"^\+\s*(?=[\d.\\])")  # '+2' is 2 (a leading plus sign, not a sum)
_SCIENTIFIC_RE = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)[eE]([-+]?\d{1,3})(?![\w.])")
_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)(?![A-Za-z])(\s*)")
_TIMEOUT_S = 2
_MAX_NUMBER_CHARS = 400  # longer text is not read as one number (and never reaches a regex
#                          that could backtrack over it)
_EDGE_CHARS = " \t\n\r\f\v$"  # stripped around a stated answer, with a trailing '.'
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _closing_braces(text: str, start: int) -> dict:
    """``{i: j}``: the ``'}'`` at j closes the ``'{'`` at i, for every brace from ``start`` on
    that closes (one pass: unclosed groups cost no rescans)."""
    opened, pairs = [], {}
    for i in range(start, len(text)):
        if text[i] == "{":
            opened.append(i)
        elif text[i] == "}" and opened:
            pairs[opened.pop()] = i
    return pairs


def _last_box(text: str):
    """``(start, content)`` of the last readable ``\\boxed{...}``/``\\fbox{...}``, or None."""
    boxes = list(_BOX_RE.finditer(text))
    pairs = _closing_braces(text, boxes[0].end()) if boxes else {}
    for match in reversed(boxes):
        if text.startswith("{", match.end()):
            if match.end() in pairs:
                return match.start(), text[match.end() + 1:pairs[match.end()]]
        elif match.group(1):
            token = re.match(r"[^\s$.,]+", text[match.end():])
            if token:
                return match.start(), token.group()
    return None


def last_boxed(text: str):
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (nested braces kept), or None.

    ``\\boxed 5`` (no braces) gives ``'5'``.
    """
    box = _last_box(text)
    return None if box is None else box[1]


def gsm8k_gold(answer_text: str) -> str:
    """The final answer of a GSM8K worked solution: the text after ``####``, commas removed."""
    return answer_text.rsplit("####", 1)[-1].strip().replace(",", "")


def final_answer(text: str, hashes: bool = True):
    """The text the last final-answer marker of ``text`` gives, '' when it gives nothing, or
    None without a marker.

    Markers: ``\\boxed{...}`` (its content), "answer is[:]" and, if ``hashes``, ``####`` (the
    rest of the line, surrounding '$' and a trailing '.' removed). The one starting last wins;
    an "answer is" followed by a verdict ("correct", "wrong", ...) is a check, not a marker.
    """
    found = _last_box(text)
    for match in reversed(list(_MARKER_RE.finditer(text))):
        if match.group() == "####" and not hashes:
            continue
        line = text[match.end():].split("\n", 1)[0].lstrip(_EDGE_CHARS)
        if match.group() != "####" and _VERDICT_RE.match(line):
            continue
        if found is None or match.start() > found[0]:
            found = match.start(), line.rstrip(_EDGE_CHARS + ".")
        break
    return None if found is None else found[1]


@functools.lru_cache(maxsize=4096)
def _parsed(latex: str, limit):
    """math-verify's reading of the answer ``latex`` (empty when unreadable or timed out);
    scientific notation ('4.5e33', which it would read as 4.5 * e * 33) is rewritten first."""
    from math_verify import parse  # here: math-verify's parser is slow to import

    latex = _SCIENTIFIC_RE.sub(r"\1\\times 10^{\2}", latex)
    return parse(f"\\boxed{{{latex}}}", parsing_timeout=limit)


def _limit():
    """math-verify's signal timeouts work on the main thread only."""
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _latex_number(latex: str):
    """A LaTeX number (``\\frac12``, ``2^{10}``, ``4.5 \\times 10^{33}``) as a Fraction, read by
    math-verify; None if it is not a rational number."""
    import sympy  # with math-verify: loaded only when a LaTeX number needs it

    parsed = _parsed(latex, _limit())
    if not parsed or not isinstance(parsed[0], sympy.Basic):
        return None
    value = sympy.nsimplify(parsed[0].doit(), rational=True)
    return Fraction(int(value.p), int(value.q)) if value.is_Rational else None


def to_number(text: str):
    """``text`` as a Fraction if it is one number (see the module docstring), else None."""
    if len(str(text)) > _MAX_NUMBER_CHARS:
        return None
    text = _LATEX_NOISE_RE.sub("", _TEXT_RE.sub("", str(text))).replace(_MINUS, "-")
    text = _UNITS_RE.sub("", text.strip().rstrip("."))
    text = _PLUS_RE.sub("", re.sub(r"^-\s+", "-", text.strip()))
    if _LATEX_RE.fullmatch(text):
        return _latex_number(text)
    text = text.replace("(", "").replace(")", "").strip()
    if not _PLAIN_RE.fullmatch(text):
        return None
    try:
        parts = [Fraction(p.replace(",", "").strip()) for p in text.split("/")]
        return parts[0] / parts[1] if len(parts) == 2 else parts[0]
    except (ValueError, ZeroDivisionError):
        return None


def _value_in(answer: str):
    """The number ``answer`` is, else the first number in it ('18, since 3*6 = 18')."""
    value = to_number(answer)
    if value is None:
        first = _VALUE_RE.search(answer)
        value = to_number(first.group()) if first else None
    return value


def _numeric_answer(text: str):
    """The number a completion gives as its final answer, or None (see :func:`numeric_reward`)."""
    answer = final_answer(text)
    if answer is not None:
        return _value_in(answer) if answer else None
    leading = _LEADING_RE.match(text)
    if leading and not _EXPRESSION_NEXT_RE.match(text, leading.end()):
        return to_number(leading.group(1))
    numbers = [m.group() for m in _VALUE_RE.finditer(text)]
    return to_number(numbers[-1]) if numbers else None


_REL_TOL = Fraction(1, 10 ** 6)


def _close(a: Fraction, b: Fraction) -> bool:
    """Integers must match exactly; otherwise a relative tolerance of 1e-6 ('0.3333333' ~ 1/3),
    in exact arithmetic and with no absolute floor: a gold of 6.626e-34 accepts
    6.6260001e-34, not 0, its negative or ten times it, and a gold of 0 only 0."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return abs(a - b) <= _REL_TOL * max(abs(a), abs(b))


def numeric_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final number equals the numeric ``gold`` (see :func:`_close`).

    The final answer is the last marker's (module docstring): the number it is, else its first
    number; an empty one scores 0. Without a marker: a number opening the completion (the
    ``arith`` form ``'85'`` or ``' 85\\n...'``, unless an operator, '=' or a word follows it),
    else the last number.
    """
    try:
        want = to_number(str(gold))
        got = _numeric_answer(str(completion))
        return float(want is not None and got is not None and _close(got, want))
    except Exception:
        return 0.0


def _normalized(latex: str) -> str:
    latex = re.sub(r"\\[dt]frac", r"\\frac", _LATEX_NOISE_RE.sub("", latex))
    return re.sub(r"\s+", "", latex).rstrip(".")


def _verify(gold: str, answer: str) -> bool:
    """math-verify equivalence, with its signal timeouts where signals work (main thread)."""
    from math_verify import verify  # here: see _parsed

    limit = _limit()
    gold_parsed, answer_parsed = _parsed(gold, limit), _parsed(answer, limit)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=limit))


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to the LaTeX ``gold``.

    The final answer is the last ``\\boxed{...}``/``\\fbox{...}`` (balanced braces) or "The
    answer is:" line, whichever comes last. Numbers (:func:`to_number`, units dropped)
    compare by value; everything else goes through math-verify (timeouts and errors count as
    wrong).
    """
    from math_verify.errors import TimeoutException  # here: see _parsed

    try:
        gold = str(gold)
        gold = last_boxed(gold) or gold
        answer = final_answer(str(completion), hashes=False)
        if answer is None or not answer.strip():
            return 0.0
        if _normalized(answer) == _normalized(gold):
            return 1.0
        want, got = to_number(gold), to_number(answer)
        if want is not None and got is not None:
            return float(_close(got, want))
        return float(_verify(gold, answer))
    except (Exception, TimeoutException):
        return 0.0
