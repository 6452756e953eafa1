"""The footprint rows' trace (c): a torch MLP with AdamW, three training
steps, recorded through PyTorch's allocation history; prints the trace as
JSON ``[[id, size], ...]`` (size 0 frees ``id``). Needs torch on a GPU."""

import json

import torch

torch.cuda.memory._record_memory_history(max_entries=1000000)
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(4096, 4096), torch.nn.GELU())],
                            torch.nn.Linear(4096, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(3):
    x = torch.randn(512, 4096, device="cuda")
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
ops, ids, n = [], {}, 0
for e in snap["device_traces"][0]:
    if e["action"] == "alloc":
        ids[e["addr"]] = n; ops.append((n, e["size"])); n += 1
    elif e["action"] == "free_requested" and e["addr"] in ids:
        ops.append((ids.pop(e["addr"]), 0))
print(json.dumps(ops))
