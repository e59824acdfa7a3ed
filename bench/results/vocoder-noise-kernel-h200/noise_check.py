import torch

from vocoder import noise

dev = torch.device("cuda")
cases = [([0, 7, 2**40 + 5, 2**63 - 1], [0, 3, 27_000_000, 123_456_789_012], 37), ([12345], [40], 20),
         (list(range(256)), [4 * i for i in range(256)], 100)]
for seeds, starts, length in cases:
    noise.OPTIONS["kernel"] = True
    got = noise.batch_frame_noise(seeds, starts, length, device=dev)
    noise.OPTIONS["kernel"] = False
    want = noise.batch_frame_noise(seeds, starts, length, device=dev)
    cpu = noise.batch_frame_noise(seeds, starts, length)
    print(len(seeds), length, "kernel==eager(cuda):", torch.equal(got.view(torch.int32), want.view(torch.int32)),
          "kernel==eager(cpu):", torch.equal(got.cpu().view(torch.int32), cpu.view(torch.int32)),
          "finite:", bool(torch.isfinite(got).all()), "std:", round(float(got.std()), 4))
