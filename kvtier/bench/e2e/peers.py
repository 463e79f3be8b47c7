"""The e2e benchmark's peers: names, the tier each needs, plot colours (no heavy imports: the CLI reads them)."""

HF_PEERS = ("hf_recompute", "hf_floor", "hf_load_bytes", "hf_load_cold_file", "hf_load_redis")
KV_PEERS = ("kvtier_recompute", "kvtier_device_cache", "kvtier_memory", "kvtier_disk_cold", "kvtier_redis")
PEERS = HF_PEERS + KV_PEERS
# The tier a peer needs (--tiers filters peers); recompute peers need none.
PEER_TIER = {"hf_floor": "memory", "hf_load_bytes": "memory", "hf_load_cold_file": "disk", "hf_load_redis": "redis",
             "kvtier_device_cache": "memory", "kvtier_memory": "memory", "kvtier_disk_cold": "disk",
             "kvtier_redis": "redis"}
# Plot order and colours: hatched HF bar beside the kvtier peer it is compared with.
PLOT_STYLE = {"hf_recompute": "tab:blue", "kvtier_recompute": "tab:blue", "hf_floor": "tab:orange",
              "kvtier_device_cache": "tab:orange", "hf_load_bytes": "tab:green", "kvtier_memory": "tab:green",
              "hf_load_cold_file": "tab:red", "kvtier_disk_cold": "tab:red", "hf_load_redis": "tab:purple",
              "kvtier_redis": "tab:purple"}
LONG_H = 4096  # the disk goal is stricter from this history length on
