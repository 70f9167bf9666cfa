"""neuron driver: AWS Inferentia and Trainium devices of the aws-neuron-driver, /dev/neuronN."""
