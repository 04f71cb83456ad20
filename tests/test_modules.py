"""The per-task modules of a client model (rayfed.models.peft.modules): found by type, also after the model changed."""

import copy
import pickle

from torch import nn

from rayfed.models import TrainableModule
from rayfed.models.peft.modules import TaskHeads, modules_of_type, select_task
from rayfed.param_names import task_key


class _Toy(TrainableModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2))


def _heads(count: int) -> TaskHeads:
    return TaskHeads({task_key(index): nn.Linear(2, 2) for index in range(count)})


def test_modules_registered_after_a_lookup_are_found_and_selected():
    model = _Toy()
    assert modules_of_type(model, (TaskHeads,)) == []
    model.heads = _heads(2)  # an attribute
    assert modules_of_type(model, (TaskHeads,)) == [model.heads]
    model.body.append(_heads(2))  # an item of a list already walked
    select_task(model, 1)
    assert modules_of_type(model, (TaskHeads,)) == [model.body[1], model.heads]
    assert model.heads.active_task == 1 and model.body[1].active_task == 1


def test_a_lookup_leaves_the_model_as_it_was_and_a_copy_finds_its_own_modules():
    model = _Toy()
    model.heads = _heads(1)
    attributes, pickled = set(vars(model)), pickle.dumps(model)
    assert modules_of_type(model, (TaskHeads,)) == [model.heads]
    assert set(vars(model)) == attributes and pickle.dumps(model) == pickled
    twin = copy.deepcopy(model)
    [found] = modules_of_type(twin, (TaskHeads,))
    assert found is twin.heads and found is not model.heads
