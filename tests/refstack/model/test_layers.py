"""The decode-shaped matmul gives x @ w whatever the row count and operand layout."""

from __future__ import annotations

import pytest
import torch

from refstack.model.layers import FEW_ROWS, Linear, matmul_rows


@pytest.mark.parametrize("rows", [1, 2, FEW_ROWS, FEW_ROWS + 1, 33])
def test_matmul_rows_equals_plain_matmul(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w_out_in = torch.randn(24, 16, generator=gen)  # stored [out, in], passed as a view
    x = torch.randn(rows, 16, generator=gen)
    got = matmul_rows(x, w_out_in.t())
    assert got.shape == (rows, 24) and got.is_contiguous()
    torch.testing.assert_close(got, x @ w_out_in.t(), rtol=1e-5, atol=1e-5)
    # A non-contiguous x (a column slice) is fine too.
    wide = torch.randn(rows, 32, generator=gen)
    torch.testing.assert_close(matmul_rows(wide[:, ::2], w_out_in.t()), wide[:, ::2] @ w_out_in.t(), rtol=1e-5, atol=1e-5)


def test_linear_matches_f_linear_for_decode_and_prefill_shapes() -> None:
    lin = Linear(16, 24, torch.Generator().manual_seed(0))
    for rows in (1, 4, 40):
        x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    # Leading batch dims keep working (the plain path).
    x3 = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(lin(x3), torch.nn.functional.linear(x3, lin.weight), rtol=1e-5, atol=1e-5)
