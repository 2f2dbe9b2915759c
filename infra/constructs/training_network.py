"""VPC mode (cdk.json ``"vpc_mode": true``): the training jobs run in private subnets of a VPC of their
own, with no route to the internet, and reach only S3 (a gateway endpoint) and each other.

Without it, SageMaker runs the containers in its own network with internet access, and the ports the
hosts open to each other (tf.data.service's dispatcher and workers, the Horovod/torchrun rendezvous,
NCCL, our gRPC data service) are reachable by whatever can reach those hosts. In VPC mode:

* every job gets ``VpcConfig`` (these subnets, this security group);
* the security group admits traffic only from itself (SageMaker's requirement for distributed
  training: every host talks to every other), and lets out only to itself and HTTPS, which in subnets
  without an internet route reaches S3 alone, through the gateway endpoint (datasets, checkpoints,
  outputs, the Neuron compile cache);
* the SageMaker role may create and remove the network interfaces SageMaker attaches (the actions the
  SageMaker developer guide lists for training jobs in a VPC);
* flow logs record every rejected connection.

Images and logs do not travel through the VPC: SageMaker pulls the image and ships the job's logs and
metrics itself. Limits: the gateway endpoint serves buckets of the stack's region only (an allowed input
bucket elsewhere is unreachable in VPC mode), and one security group serves all the platform's jobs, so
the hosts of two concurrent runs can reach each other's ports (our gRPC data service checks the job's
token on every call; tf.data.service, the rendezvous and NCCL do not): the boundary is the platform's
jobs, not one job.
"""

from __future__ import annotations

from aws_cdk import RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from infra.constructs.functions import retention
from infra.nag import acknowledge, wildcard_resources

# What SageMaker does with the job's role in a VPC (SageMaker developer guide, "CreateTrainingJob API:
# Execution Role Permissions", VPC section). None of these take a resource ARN that exists beforehand.
NETWORK_INTERFACE_ACTIONS = (
    "ec2:CreateNetworkInterface", "ec2:CreateNetworkInterfacePermission", "ec2:DeleteNetworkInterface",
    "ec2:DeleteNetworkInterfacePermission", "ec2:DescribeNetworkInterfaces", "ec2:DescribeVpcs", "ec2:DescribeDhcpOptions",
    "ec2:DescribeSubnets", "ec2:DescribeSecurityGroups",
)


class TrainingNetwork(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, sagemaker_role: iam.Role, log_retention_days: int) -> None:
        super().__init__(scope, construct_id)
        self.vpc = ec2.Vpc(
            # Three AZs where the account is known at synthesis (two otherwise): GPU and Trainium
            # capacity is per AZ, and SageMaker places a job only in its subnets' AZs.
            self, "Vpc", max_azs=3, nat_gateways=0,
            subnet_configuration=[ec2.SubnetConfiguration(name="training", subnet_type=ec2.SubnetType.PRIVATE_ISOLATED, cidr_mask=20)],
        )
        flow_logs = logs.LogGroup(self, "FlowLogs", retention=retention(log_retention_days), removal_policy=RemovalPolicy.DESTROY)
        self.vpc.add_flow_log("FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs),
                              traffic_type=ec2.FlowLogTrafficType.REJECT)
        self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        self.security_group = ec2.SecurityGroup(
            self, "Hosts", vpc=self.vpc, allow_all_outbound=False,
            description="Training hosts: each other (data service, rendezvous, collectives), and S3 through the gateway endpoint",
        )
        self.security_group.add_ingress_rule(self.security_group, ec2.Port.all_traffic(), "hosts of the platform's jobs")
        self.security_group.add_egress_rule(self.security_group, ec2.Port.all_traffic(), "hosts of the platform's jobs")
        # HTTPS out to any address: the isolated subnets have no internet route, so the one place it
        # reaches is S3, through the gateway endpoint's routes (a prefix-list rule would need a
        # context lookup against a real account at synthesis).
        self.security_group.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "S3 via the gateway endpoint (no other route)")
        sagemaker_role.add_to_policy(iam.PolicyStatement(actions=list(NETWORK_INTERFACE_ACTIONS), resources=["*"]))
        acknowledge(sagemaker_role, "SageMaker attaches network interfaces in the job's VPC with the job's role; these EC2 actions take "
                                    "no resource ARN known beforehand (SageMaker developer guide, training in a VPC).",
                    *wildcard_resources("*"))

    @property
    def subnet_ids(self) -> list[str]:
        return self.vpc.select_subnets(subnet_type=ec2.SubnetType.PRIVATE_ISOLATED).subnet_ids

