"""torch's OpInfo error inputs (op_db's `error_inputs`): calls eager refuses (a source of the
wrong shape, an index out of range, an out tensor of another type), each of which tjit must
refuse too, never return a value. The sample's tensors are the compiled function's arguments
(as tests/test_opinfo.py does); a sample eager runs after all (its error is CUDA's or a
warning) is skipped. Most raise eager's own error (type and message: 561 of 568 samples when
written); OTHER_WORDS and OTHER_TYPE list those whose error is tjit's own, NOT_RAISED the calls tjit
still runs, with their causes, as strict xfails so that a fix is noticed.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import tjit
from test_opinfo import opinfo_id, sample_program

SAMPLES_PER_OP = 6

# eager's kernels check these; torch's meta functions (which tjit's trace runs) do not
NOT_RAISED = {
    "aminmax[3]": "an out tensor of another type than the result's: tjit casts into it",
    "multinomial[2]": "an out tensor of another type than int64: tjit casts into it",
}
# refused with eager's type of error and words of tjit's
OTHER_WORDS = {"gather[4]", "scatter[3]", "scatter_add[3]"}  # (a kernel's index check: IndexOutOfBoundsError)
# refused with another type of error
OTHER_TYPE = {"gradient[3]"}  # (CompileArgumentError: tensors on several devices, meta among them)


def _error_samples():
    for op in op_db:
        try:
            errors = list(op.error_inputs(torch.device("cpu")))
        except Exception:  # noqa: BLE001 (an OpInfo whose error inputs need a device it lacks)
            continue
        for k, error in enumerate(errors[:SAMPLES_PER_OP]):
            name = f"{opinfo_id(op)}[{k}]"
            marks = [pytest.mark.xfail(strict=True, reason=NOT_RAISED[name])] if name in NOT_RAISED else []
            yield pytest.param(op, error, id=name, marks=marks)


@pytest.mark.parametrize("op, error", list(_error_samples()))
def test_a_call_eager_refuses_is_refused(op, error, request):
    call, tensors = sample_program(op, error.sample_input)
    try:
        call(*[t.clone() for t in tensors])
    except Exception:  # noqa: BLE001
        pass
    else:
        pytest.skip("eager runs this sample on the CPU")
    given = [t.clone() for t in tensors]
    with pytest.raises(Exception) as raised:
        tjit.compile(call)(*given)
    name = request.node.callspec.id
    assert name in OTHER_TYPE or isinstance(raised.value, error.error_type), raised.value
    assert name in OTHER_TYPE | OTHER_WORDS or re.search(error.error_regex, str(raised.value)), raised.value
    for t, before in zip(given, tensors):  # (untouched: an error leaves the arguments as they were)
        if t.device.type == "cpu" and t.layout == torch.strided:
            torch.testing.assert_close(t.reshape(-1), before.reshape(-1), rtol=0, atol=0, equal_nan=True)
