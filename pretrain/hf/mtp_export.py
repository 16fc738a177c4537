"""What `make export` does with multi-token prediction layers (model.mtp_num_layers; docs/mtp.md): drops them.

GPT-2, Llama and Mixtral have no MTP module, and transformers' DeepseekV3ForCausalLM does not load one either
(DeepSeek's own HF release keeps layer 61, its MTP module, in the safetensors; transformers skips it). The
exported model is the main next-token model; the MTP tensors are named and counted in export.json and on the
console, so nothing leaves silently. Training from the megatron checkpoint keeps them.
"""
from __future__ import annotations

MTP_PREFIX = "mtp."


def drop_mtp(state: dict) -> tuple[dict, dict | None]:
    """(state without the MTP layers' tensors, a note for export.json: what was dropped and why; None: none)."""
    dropped = sorted(k for k in state if k.startswith(MTP_PREFIX))
    if not dropped:
        return state, None
    kept = {k: v for k, v in state.items() if not k.startswith(MTP_PREFIX)}
    layers = sorted({k.split(".")[2] for k in dropped}, key=int)
    note = {"dropped": "mtp", "layers": len(layers), "tensors": len(dropped),
            "params": sum(state[k].numel() for k in dropped),
            "reason": "model.mtp_num_layers: the HF architecture has no multi-token prediction module (transformers' "
                      "DeepseekV3 ignores DeepSeek's too); the export is the main next-token model"}
    return kept, note


def note_text(note: dict) -> str:
    return (f">> export: dropped {note['layers']} MTP layer(s) ({note['tensors']} tensors, {note['params']:,} "
            f"parameters; model.mtp_num_layers): {note['reason']}")
