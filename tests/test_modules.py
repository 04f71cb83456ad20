"""The per-task modules of a client model (rayfed.models.peft.modules): found by type, also after the model changed."""

import copy
import pickle

from torch import nn

from rayfed.models import TrainableModule
from rayfed.models.module_walks import modules_of_type
from rayfed.models.peft.modules import TaskHeads, select_task
from rayfed.param_names import task_key


class _Toy(TrainableModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2))

    def forward(self, features):
        return self.body(features)


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


def test_a_model_whose_walks_are_kept_is_freed_with_its_last_reference():
    """The kept values never hold the model itself (they are weakly keyed by it): an actor's method models, and the
    bench's ideal, are freed once dropped."""
    import gc
    import weakref

    import torch

    from rayfed.models.module_walks import functional_forward, named_parameter_table

    model = _Toy()
    model.own = nn.Parameter(torch.zeros(2))  # a parameter of the model itself
    model.heads = _heads(1)
    model.eval()
    model.train()
    assert modules_of_type(model, (_Toy,)) == [model] and set(named_parameter_table(model)) >= {"own"}
    functional_forward(model.body, {"0.weight": torch.ones(2, 2)}, torch.ones(1, 2))
    functional_forward(model, {"own": torch.ones(2)}, torch.ones(1, 2))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


class _OwnTrain(nn.Sequential):
    """A submodule with a ``train`` of its own (as an HF model has): it must get its call."""

    calls: list[bool]

    def train(self, mode: bool = True) -> "_OwnTrain":
        self.calls.append(mode)
        return super().train(mode)


def _flags(model: nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


def test_a_mode_switch_sets_every_flag_nn_module_train_sets_also_of_modules_added_after_the_last_switch():
    model = _Toy()
    model.eval()
    model.body.append(nn.Dropout(0.5))  # registered after the switch: a fresh module is in training mode
    model.extra = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    model.eval()
    assert not any(_flags(model))
    model.body[0].train()  # one module on its own, then the whole model back
    model.eval()
    assert not any(_flags(model))
    model.train()
    assert all(_flags(model))


def test_a_submodule_with_its_own_train_gets_its_call_and_covers_its_part():
    model = _Toy()
    own = _OwnTrain(nn.Linear(2, 2), nn.Dropout(0.5))
    own.calls = []
    model.body.append(own)
    model.eval()
    assert own.calls == [False] and not any(_flags(model))
    model.train()
    assert own.calls == [False, True] and all(_flags(model))


def test_a_parameter_registered_after_a_load_is_loaded():
    import torch

    model = _Toy()
    model.load_trainable({"body.0.bias": torch.ones(2)})
    model.body[0].scale = nn.Parameter(torch.zeros(2))  # registered after the names were looked up
    model.load_trainable({"body.0.scale": torch.full((2,), 3.0)})
    assert model.body[0].scale.tolist() == [3.0, 3.0]
    model.body[0].weight = nn.Parameter(torch.zeros(2, 2))  # a parameter replaced: the new one gets the values
    model.load_trainable({"body.0.weight": torch.ones(2, 2)})
    assert model.body[0].weight.sum().item() == 4.0


def test_a_functional_forward_replaces_every_name_of_a_tensor_tied_also_after_an_earlier_call():
    import torch

    from rayfed.models.module_walks import functional_forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    x, value = torch.randn(3, 2), {"0.weight": torch.randn(2, 2)}
    assert torch.equal(functional_forward(model, value, x), torch.func.functional_call(model, value, (x,)))
    model[1].weight = model[0].weight  # tied after the first call: the value stands for both names now
    expected = x @ value["0.weight"].T @ value["0.weight"].T
    assert torch.equal(functional_forward(model, value, x), expected)
    assert torch.equal(torch.func.functional_call(model, value, (x,)), expected)


def test_parameters_put_in_place_without_a_registration_are_loaded_and_untied():
    """``nn.Module._apply`` between tensor types (here from the meta device) puts new parameters in place without a
    registration, and breaks a tie."""
    import torch

    from rayfed.models.module_walks import functional_forward, named_parameter_table

    class Chain(_Toy):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    model = Chain()
    model.body.append(nn.Linear(2, 2, bias=False))
    model.to_empty(device="meta")
    model.body[1].weight = model.body[0].weight
    x, value = torch.ones(1, 2), {"body.0.weight": torch.eye(2)}
    functional_forward(model, {"body.0.weight": torch.eye(2, device="meta")}, x.to("meta"))  # the tie map, on meta
    model.load_trainable({"body.0.bias": torch.ones(2, device="meta")})  # the names, on the meta device
    model.to_empty(device="cpu")
    assert model.body[1].weight is not model.body[0].weight
    model.load_trainable({"body.0.bias": torch.ones(2), "body.0.weight": torch.eye(2)})
    model.load_trainable({"body.1.weight": torch.zeros(2, 2)})  # untied: a name of its own
    assert list(named_parameter_table(model)) == [name for name, _ in model.named_parameters()]
    assert model.body[0].bias.tolist() == [1.0, 1.0]
    assert torch.equal(functional_forward(model, value, x), torch.func.functional_call(model, value, (x,)))
