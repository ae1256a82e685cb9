"""Does a compiled (reduce-overhead) convnet survive its weights' layout changed under it? One H200."""
import torch, torch.nn as nn
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)).cuda()
x = torch.randn(8, 3, 64, 64, device="cuda")
m.to(memory_format=torch.channels_last)
m.compile(mode="reduce-overhead")
for i, fmt in enumerate([torch.channels_last] * 3 + [torch.contiguous_format] * 3 + [torch.channels_last] * 3):
    m.to(memory_format=fmt)
    try:
        with torch.autocast("cuda", torch.bfloat16):
            m(x.to(memory_format=fmt)).float().sum().backward()
        torch.cuda.synchronize(); print(i, "ok", fmt)
    except Exception as e:
        print(i, "ERR", fmt, type(e).__name__, str(e)[:200])
