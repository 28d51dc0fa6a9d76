"""What a watch holds: the bytes of tensor storage reachable from an object."""

import gc
import sys
import types

import torch
from torch import nn


def tensor_bytes_reachable(root: object) -> int:
    """Bytes of the tensor storages reachable from `root`, not counting what modules (the model) and the globals
    of functions (a hook's module) hold."""
    seen, storages, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (nn.Module, type, type(sys))):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, types.FunctionType):
            todo.extend(cell.cell_contents for cell in obj.__closure__ or ())
            todo.extend((obj.__defaults__ or ()) + tuple((obj.__kwdefaults__ or {}).values()))
        else:
            todo.extend(gc.get_referents(obj))
    return sum(storages.values())


def python_bytes_reachable(root: object) -> int:
    """Bytes of the Python objects reachable from `root` (`sys.getsizeof` of each, once) and of the tensor storages
    among them, not counting what modules, types and the globals of functions hold (as `tensor_bytes_reachable`), nor
    the small ints Python shares (-5 to 256: no object holds one of its own)."""
    seen, storages, total, todo = set(), {}, 0, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (nn.Module, type, type(sys))):
            continue
        seen.add(id(obj))
        if type(obj) is int and -5 <= obj <= 256:
            continue
        total += sys.getsizeof(obj)
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, types.FunctionType):
            todo.extend(cell.cell_contents for cell in obj.__closure__ or ())
            todo.extend((obj.__defaults__ or ()) + tuple((obj.__kwdefaults__ or {}).values()))
        else:
            todo.extend(gc.get_referents(obj))
    return total + sum(storages.values())
