"""One step of work on the device: the engine (composes the manager, connector and model
runner), the runner's compiled steps, layer-major prefill, the connector and sampling."""
