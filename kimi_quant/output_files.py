"""The names of the files kimi-quant writes into an ascendV1 output directory, and how it calls a local source."""

INDEX = "quant_model_weights.safetensors.index.json"
DESCRIPTION = "quant_model_description.json"
PROVENANCE = "kimi_quant_provenance.json"
VALIDATION = "kimi_quant_validation.json"
CARD = "README.md"
#: a calibrated run's state between layers (activations of the calibration text): removed when the run ends
CALIB_STATE = "kimi_quant_calib_state.safetensors"
#: what the provenance and the card say of a local source directory
LOCAL_SOURCE = "local checkpoint"
