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
* the S3 endpoint's policy admits the platform's buckets alone (results, datasets, cdk.json's
  input_buckets): job code cannot read from, or write to, any other bucket through it, whatever
  credentials it holds;
* the SageMaker role may create and remove the network interfaces SageMaker attaches (the actions the
  SageMaker developer guide lists for training jobs in a VPC), in this VPC's subnets, with this security
  group, and on interfaces in this VPC only;
* flow logs record every rejected connection.

Images and logs do not travel through the VPC: SageMaker pulls the image and ships the job's logs and
metrics itself ("SageMaker AI automatically pulls the training container image from Amazon ECR": the
developer guide, training in a VPC, asks for no ECR endpoint), so the endpoint policy leaves out the ECR
layer buckets (prod-<region>-starport-layer-bucket) that a pull inside the VPC would need, and the DLC
base images are pulled where the images are built, never by a job. Limits: the gateway endpoint serves
buckets of the stack's region only (an allowed input
bucket elsewhere is unreachable in VPC mode), and one security group serves all the platform's jobs, so
the hosts of two concurrent runs can reach each other's ports (our gRPC data service checks the job's
token on every call; tf.data.service, the rendezvous and NCCL do not): the boundary is the platform's
jobs, not one job.
"""

from __future__ import annotations

from collections.abc import Iterable

from aws_cdk import RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.constructs.functions import retention
from infra.nag import S3_READ_ACTIONS, S3_WRITE_ACTIONS, acknowledge, wildcard_resources

# What SageMaker does with the job's role in a VPC (SageMaker developer guide, "CreateTrainingJob API:
# Execution Role Permissions", VPC section). The four that act on network interfaces take resource ARNs
# (IAM's service authorization reference for EC2: network-interface, and for the create also subnet and
# security-group, each with the ec2:Vpc condition key); the Describe actions take none.
INTERFACE_ACTIONS = ("ec2:CreateNetworkInterfacePermission", "ec2:DeleteNetworkInterface")
DESCRIBE_ACTIONS = ("ec2:DescribeNetworkInterfaces", "ec2:DescribeVpcs", "ec2:DescribeDhcpOptions", "ec2:DescribeSubnets",
                    "ec2:DescribeSecurityGroups")
# What the endpoint lets through to the platform's buckets: what the SageMaker role may do there (reads,
# writes, multipart uploads); the role's own policy holds each bucket to its prefixes.
ENDPOINT_S3_ACTIONS = (*S3_READ_ACTIONS, "s3:PutObject*", *S3_WRITE_ACTIONS)


class TrainingNetwork(Construct):
    def __init__(
        self, scope: Construct, construct_id: str, *, sagemaker_role: iam.Role, buckets: Iterable[s3.IBucket], log_retention_days: int,
    ) -> None:
        """``buckets``: every bucket jobs read or write (results, datasets, the allowed input buckets); the
        S3 endpoint reaches these and no others."""
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self.vpc = ec2.Vpc(
            # Three AZs where the account is known at synthesis (two otherwise): GPU and Trainium
            # capacity is per AZ, and SageMaker places a job only in its subnets' AZs.
            self, "Vpc", max_azs=3, nat_gateways=0,
            subnet_configuration=[ec2.SubnetConfiguration(name="training", subnet_type=ec2.SubnetType.PRIVATE_ISOLATED, cidr_mask=20)],
        )
        flow_logs = logs.LogGroup(self, "FlowLogs", retention=retention(log_retention_days), removal_policy=RemovalPolicy.DESTROY)
        self.vpc.add_flow_log("FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs),
                              traffic_type=ec2.FlowLogTrafficType.REJECT)
        self.s3_endpoint = self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        buckets = list(buckets)
        # An endpoint policy replaces the default (any bucket, any action): the platform's buckets only.
        self.s3_endpoint.add_to_policy(iam.PolicyStatement(
            sid="PlatformBucketsOnly", principals=[iam.AnyPrincipal()], actions=list(ENDPOINT_S3_ACTIONS),
            resources=[arn for bucket in buckets for arn in (bucket.bucket_arn, bucket.arn_for_objects("*"))],
        ))
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

        def ec2_arn(resource: str, name: str) -> str:
            return stack.format_arn(service="ec2", resource=resource, resource_name=name)

        in_this_vpc = {"ArnEquals": {"ec2:Vpc": ec2_arn("vpc", self.vpc.vpc_id)}}
        interfaces = ec2_arn("network-interface", "*")  # created by SageMaker at each job's start: no ID beforehand
        # Each resource of a request is authorized on its own, with the condition keys its type has (the
        # service authorization reference): CreateNetworkInterface's subnet and security group carry ec2:Vpc,
        # the interface it creates does not (a condition on an absent key denies), so the subnets and group
        # are what hold the create to the training VPC.
        sagemaker_role.add_to_policy(iam.PolicyStatement(
            sid="CreateJobInterfacesInTheTrainingSubnets", actions=["ec2:CreateNetworkInterface"],
            resources=[*(ec2_arn("subnet", subnet_id) for subnet_id in self.subnet_ids),
                       ec2_arn("security-group", self.security_group.security_group_id)],
            conditions=in_this_vpc,
        ))
        sagemaker_role.add_to_policy(iam.PolicyStatement(
            sid="CreateJobInterfaces", actions=["ec2:CreateNetworkInterface"], resources=[interfaces],
        ))
        sagemaker_role.add_to_policy(iam.PolicyStatement(
            sid="ManageJobInterfacesInTheTrainingVpc", actions=list(INTERFACE_ACTIONS), resources=[interfaces], conditions=in_this_vpc,
        ))
        # Its network-interface resource is optional (the request names a permission, not always an
        # interface): scoped to interfaces, a request without one would be denied; held to the training VPC
        # whenever the request names an interface (IfExists).
        sagemaker_role.add_to_policy(iam.PolicyStatement(
            sid="RevokeJobInterfacePermissions", actions=["ec2:DeleteNetworkInterfacePermission"], resources=["*"],
            conditions={"ArnEqualsIfExists": in_this_vpc["ArnEquals"]},
        ))
        sagemaker_role.add_to_policy(iam.PolicyStatement(sid="DescribeTheTrainingNetwork", actions=list(DESCRIBE_ACTIONS), resources=["*"]))
        acknowledge(sagemaker_role, "SageMaker creates each job's network interfaces at its start (no ID known beforehand): the "
                                    "create held to the training subnets and security group, the rest by condition to the training VPC "
                                    "(ec2:Vpc); the EC2 Describe actions take no resource ARN, and DeleteNetworkInterfacePermission's "
                                    "interface is optional in its request (service authorization reference for EC2).",
                    *wildcard_resources("*", f"arn:<AWS::Partition>:ec2:{stack.region}:<AWS::AccountId>:network-interface/*"))

    @property
    def subnet_ids(self) -> list[str]:
        return self.vpc.select_subnets(subnet_type=ec2.SubnetType.PRIVATE_ISOLATED).subnet_ids

