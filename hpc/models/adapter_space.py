"""Search spaces over a peft LoRA adapter: flat float64 vectors <-> LoRA factor weights.

A vector holds OFFSETS from the SFT adapter, so the zero vector is the SFT adapter bit for bit.
Factors are visited in sorted module-name order, A (r, in) before B (out, r) in each module;
every factor owns one contiguous slice of the vector. Only the ``default`` adapter is used.

* :class:`SingularValueSpace` (ESSA): each factor W = U diag(s) Vh (float64 SVD, U and Vh
  fixed); the slice holds offsets x to the top k = ceil(alpha * r) singular values, giving
  W' = W + U_k diag(x) Vh_k = U diag(s + x) Vh (x padded with zeros past k).
* :class:`LoraEntrySpace`: the slice holds offsets to every entry of the factor, W' = W + x.

The additive form keeps x = 0 exact: W + 0 in float64 is W, and casting back is lossless.
ESSA searches these vectors without gradients; :meth:`SingularValueSpace.parametrize` makes the
same offsets trainable by gradient (F-GRPO's ``fgrpo.space=sv``), with the same W'(x).
"""
import math
from dataclasses import dataclass

import numpy as np
import torch
from peft.tuners.lora import LoraLayer
from torch.nn.utils import parametrize

from hpc.runtime.atomic import replaced_dir
from hpc.runtime.errors import UserError

ADAPTER = "default"
_WHICH = ("lora_A", "lora_B")


@dataclass
class _Factor:
    """One LoRA factor weight and the slice [start, stop) of the vector that it owns."""

    module: str  # name in peft_model.named_modules()
    which: str  # "lora_A" (r, in) or "lora_B" (out, r)
    w0: torch.Tensor  # (rows, cols) float64 copy of the SFT weight, on the weight's device
    dtype: torch.dtype  # the model's dtype for this weight
    start: int
    stop: int


@dataclass
class _SvdFactor(_Factor):
    """A factor with its searched singular triplets: W = U_k diag(s_k) Vh_k + rest."""

    u: torch.Tensor  # (rows, k) float64, orthonormal columns
    s: torch.Tensor  # (k,) float64, descending
    vh: torch.Tensor  # (k, cols) float64, orthonormal rows


def _lora_modules(peft_model, targets) -> list:
    """(name, LoraLayer) of every module carrying the default adapter, sorted by name."""
    found = sorted((name, mod) for name, mod in peft_model.named_modules()
                   if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A)
    if not found:
        raise UserError(f"{type(peft_model).__name__} is not a LoRA model: it has no "
                        f"'{ADAPTER}' LoRA adapter modules (run the SFT stage first)")
    kinds = {name.rsplit(".", 1)[-1] for name, _ in found}
    missing = sorted(set(targets) - kinds)
    if missing:
        raise UserError(f"the LoRA adapter does not adapt {', '.join(missing)} "
                        f"(it adapts {', '.join(sorted(kinds))})")
    for name, mod in found:
        if any(getattr(mod, which)[ADAPTER].weight.dim() != 2 for which in _WHICH):
            raise UserError(f"{name}: only LoRA on Linear layers is supported")
    return found


def _weight(peft_model, f: _Factor) -> torch.nn.Parameter:
    return getattr(peft_model.get_submodule(f.module), f.which)[ADAPTER].weight


class _AdapterSpace:
    """Shared vector <-> weights plumbing. Subclasses define, per factor f:

    * ``_delta(f, x)``: (stop - start,) float64 offsets -> (rows, cols) float64 weight change;
    * ``_delta_batch(f, x)``: the same for (P, stop - start) -> (P, rows, cols);
    * ``_project(f, d)``: (rows, cols) float64 weight change -> (stop - start,) offsets.
    """

    def __init__(self, factors: list):
        self._factors = factors

    @property
    def dim(self) -> int:
        """Length of a search vector."""
        return self._factors[-1].stop

    @property
    def modules(self) -> list:
        """Adapted module names, in vector order."""
        return [f.module for f in self._factors[::2]]

    def held_tensors(self) -> list:
        """The tensors the space keeps on the adapter's device (each factor's float64 copy, and
        its SVD's U, s and Vh in :class:`SingularValueSpace`): what the memory plan charges as
        the search space (:func:`hpc.plan.terms.search_space_bytes`)."""
        return [t for f in self._factors for t in vars(f).values() if torch.is_tensor(t)]

    def _checked(self, x, ndim: int) -> torch.Tensor:
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != ndim or x.shape[-1] != self.dim:
            want = "(dim,)" if ndim == 1 else "(members, dim)"
            raise UserError(f"search vector of shape {x.shape} does not fit this space: "
                            f"expected {want} with dim = {self.dim}")
        if not np.all(np.isfinite(x)):
            raise UserError("search vector holds NaN or infinite values")
        return torch.from_numpy(x)

    def _pairs(self, weights: list) -> dict:
        return dict(zip(self.modules, zip(weights[::2], weights[1::2])))

    def factors(self, x: np.ndarray) -> dict:
        """Vector (dim,) -> {module: (A' (r, in), B' (out, r))} in the model's dtypes."""
        x = self._checked(x, 1)
        return self._pairs([
            (f.w0 + self._delta(f, x[f.start:f.stop].to(f.w0.device))).to(f.dtype)
            for f in self._factors])

    def factors_batch(self, xs: np.ndarray) -> dict:
        """Vectors (P, dim) -> {module: (A' (P, r, in), B' (P, out, r))} in the model's dtypes.

        One batched matmul per factor over all P members; peak extra memory is P times one
        factor in float64.
        """
        xs = self._checked(xs, 2)
        return self._pairs([
            (f.w0 + self._delta_batch(f, xs[:, f.start:f.stop].to(f.w0.device))).to(f.dtype)
            for f in self._factors])

    def apply(self, peft_model, x: np.ndarray) -> None:
        """Write the adapter of vector x (dim,) into ``peft_model``'s LoRA weights in place."""
        with torch.no_grad():
            for name, (a, b) in self.factors(x).items():
                module = peft_model.get_submodule(name)
                module.lora_A[ADAPTER].weight.copy_(a)
                module.lora_B[ADAPTER].weight.copy_(b)

    def to_vector_of(self, peft_model) -> np.ndarray:
        """The vector (dim,) float64 of the adapter now in ``peft_model`` (inverse of apply)."""
        with torch.no_grad():
            return torch.cat([
                self._project(f, _weight(peft_model, f).to(torch.float64) - f.w0).cpu()
                for f in self._factors]).numpy()

    def export_adapter(self, peft_model, x: np.ndarray, out_dir: str) -> None:
        """Save vector x as a plain peft adapter directory (adapter_config.json +
        adapter_model.safetensors), written to a temporary sibling and renamed into place.
        ``peft_model``'s weights are left as they were. Call on one rank only."""
        weights = [_weight(peft_model, f) for f in self._factors]
        saved = [w.detach().clone() for w in weights]
        try:
            with replaced_dir(out_dir) as tmp:
                self.apply(peft_model, x)
                peft_model.save_pretrained(tmp, selected_adapters=[ADAPTER])
        finally:
            with torch.no_grad():
                for w, s in zip(weights, saved):
                    w.copy_(s)


def searched_count(alpha: float, rank: int) -> int:
    """ceil(alpha * rank) singular values searched per factor, immune to float noise
    (0.14 * 50 is 7.000000000000001 in binary floating point)."""
    return max(1, math.ceil(round(alpha * rank, 9)))


class SingularValueSpace(_AdapterSpace):
    """ESSA space: offsets to the top ceil(alpha * r) singular values of every LoRA factor.

    dim = modules x 2 x ceil(alpha * r) (e.g. layers x 4 x 2 x ceil(alpha * r) for q/k/v/o).
    """

    @classmethod
    def from_peft(cls, peft_model, alpha: float = 1.0, targets=()) -> "SingularValueSpace":
        """SVD (float64, thin) every factor of the default adapter. ``targets``: module types
        (e.g. ``["q_proj", "v_proj"]``) that the adapter must adapt."""
        if not 0.0 < alpha <= 1.0:
            raise UserError(f"alpha must be in (0, 1], got {alpha}")
        factors, start = [], 0
        with torch.no_grad():
            for name, mod in _lora_modules(peft_model, targets):
                for which in _WHICH:
                    w = getattr(mod, which)[ADAPTER].weight
                    w0 = w.detach().to(torch.float64, copy=True)
                    u, s, vh = torch.linalg.svd(w0, full_matrices=False)
                    k = searched_count(alpha, s.numel())
                    factors.append(_SvdFactor(name, which, w0, w.dtype, start, start + k,
                                              u[:, :k].contiguous(), s[:k].clone(),
                                              vh[:k].contiguous()))
                    start += k
        return cls(factors)

    def singular_values(self) -> np.ndarray:
        """The SFT adapter's searched singular values s (dim,) float64, in vector order."""
        return torch.cat([f.s.cpu() for f in self._factors]).numpy()

    def parametrize(self, peft_model) -> list:
        """Make the offsets trainable by gradient: every other parameter of ``peft_model`` is
        frozen and each factor weight becomes W'(x) (:class:`_OffsetParametrization`, via
        ``torch.nn.utils.parametrize``). Returns the offsets, one (k,) float64 parameter per
        factor in vector order, all zero: the model is then the SFT adapter bit for bit.
        Build the space from the unparametrized model; call once."""
        peft_model.requires_grad_(False)
        offsets = []
        for f in self._factors:
            holder = getattr(peft_model.get_submodule(f.module), f.which)[ADAPTER]
            offset = _OffsetParametrization(f)
            parametrize.register_parametrization(holder, "weight", offset)
            offsets.append(offset.x)
        return offsets

    def save_parametrized(self, peft_model, out_dir: str) -> None:
        """Save a parametrized model's adapter W'(x) as a plain peft adapter directory
        (adapter_config.json + adapter_model.safetensors, the keys an unparametrized adapter
        has), written to a temporary sibling and renamed into place. Call on one rank only."""
        with torch.no_grad():
            plain = {f"{f.module}.{f.which}.{ADAPTER}.weight": _weight(peft_model, f).detach()
                     for f in self._factors}
        with replaced_dir(out_dir) as tmp:
            peft_model.save_pretrained(tmp, selected_adapters=[ADAPTER], state_dict=plain)

    def _delta(self, f, x):
        return (f.u * x) @ f.vh

    def _delta_batch(self, f, x):
        return (f.u * x[:, None, :]) @ f.vh

    def _project(self, f, d):
        # diag(U_k^T W' Vh_k^T) - s = diag(U_k^T (W' - W) Vh_k^T), the second without cancellation
        return ((f.u.T @ d) * f.vh).sum(dim=1)


class _OffsetParametrization(torch.nn.Module):
    """torch parametrization of one LoRA factor weight W (rows, cols): the weight the model
    uses is W'(x) = (W + U_k diag(x) Vh_k) in float64, cast back to W's dtype, exactly as
    :meth:`SingularValueSpace.factors` builds it; x (k,) float64 is the trained parameter, U_k
    and Vh_k fixed buffers (not saved in state dicts)."""

    def __init__(self, f: _SvdFactor):
        super().__init__()
        self.register_buffer("u", f.u, persistent=False)
        self.register_buffer("vh", f.vh, persistent=False)
        self.x = torch.nn.Parameter(torch.zeros_like(f.s))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (w.to(torch.float64) + (self.u * self.x) @ self.vh).to(w.dtype)


class LoraEntrySpace(_AdapterSpace):
    """Every LoRA entry: offsets to A (r, in) and B (out, r) of every module, row-major.

    dim = sum over modules of r * (in + out).
    """

    @classmethod
    def from_peft(cls, peft_model, targets=()) -> "LoraEntrySpace":
        """Index every factor of the default adapter; ``targets`` as for SingularValueSpace."""
        factors, start = [], 0
        with torch.no_grad():
            for name, mod in _lora_modules(peft_model, targets):
                for which in _WHICH:
                    w = getattr(mod, which)[ADAPTER].weight
                    factors.append(_Factor(name, which, w.detach().to(torch.float64, copy=True),
                                           w.dtype, start, start + w.numel()))
                    start += w.numel()
        return cls(factors)

    def _delta(self, f, x):
        return x.reshape(f.w0.shape)

    def _delta_batch(self, f, x):
        return x.reshape(x.shape[0], *f.w0.shape)

    def _project(self, f, d):
        return d.reshape(-1)
