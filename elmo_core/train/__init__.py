"""Training the biLM: the objective, checkpoints, the loop, evaluation, export, and the launch on several ranks.

checkpoint    training checkpoints (one record per rank; the best weights) with their SHA-256, verified
tracking      the tracker interface (MLflow or nothing) and MLflow model URIs
loop          the training loop: setup, train_step, save/restore, finish; DDP
launch        training on several processes: torch.distributed.run started and owned by the train stage
mlflow_model  an exported model as an MLflow pyfunc model
"""
